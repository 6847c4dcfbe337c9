"""The Triton LoRA kernels against the torch path (lora/layer's masked product): ragged slots,
base and padding tokens (-1), ranks padded to the slot width, float32 and bfloat16. Run under
Triton's interpreter on a machine without CUDA (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from batchgen.engine.triton import support

if not support.interpreting() and not torch.cuda.is_available():
    pytest.skip("neither Triton's interpreter nor CUDA", allow_module_level=True)

from batchgen import LLM, LoRARequest
from batchgen.engine.lora.triton_kernel import lora_add, lora_add_op

from .test_lora_api import GREEDY, PROMPTS, build_adapters, reference

DEVICE = torch.device("cpu" if support.interpreting() else "cuda")


def _torch_path(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int) -> torch.Tensor:
    column_slot = torch.arange(a.shape[0], device=x.device) // rank
    mask = (slots[:, None] == column_slot).to(x.dtype)
    return torch.nn.functional.linear(torch.nn.functional.linear(x, a) * mask, b)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("in_features", "out_features", "rank"), [(64, 96, 8), (100, 40, 3)])
def test_kernels_equal_the_torch_path(
    dtype: torch.dtype, tolerance: float, in_features: int, out_features: int, rank: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    slots_n, tokens = 3, 11
    x = torch.randn(tokens, in_features, generator=gen).to(dtype).to(DEVICE)
    a = torch.randn(slots_n * rank, in_features, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(out_features, slots_n * rank, generator=gen).to(dtype).to(DEVICE)
    a[rank + rank // 2 : 2 * rank] = 0  # slot 1 holds a smaller rank, zero-padded
    b[:, rank + rank // 2 : 2 * rank] = 0
    slots = torch.tensor([0, 2, -1, 1, 1, 0, -1, 2, 2, 1, -1], device=DEVICE)
    y = torch.randn(tokens, out_features, generator=gen).to(dtype).to(DEVICE)
    expected = (y.double() + _torch_path(x.double(), slots, a.double(), b.double(), rank)).to(dtype)
    got = lora_add_op(y, x, slots, a, b, rank)
    assert torch.equal(got[slots < 0], y[slots < 0])  # base and padding rows: exactly untouched
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance * 10)
    lora_add(y, x, slots, a, b, rank)  # the in-place launcher
    assert torch.equal(y, got)


def test_engine_with_the_kernels_equals_the_merged_models(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    """The triton attention backend takes the LoRA kernels too: rows of two adapters and the base
    model in one batch, each equal to its merged model's greedy tokens."""
    base, small, big = build_adapters(tiny_model("llama"), tmp_path)
    llm = LLM(str(base), device=str(DEVICE), dtype="float32", compile=False, attention_backend="triton",
              enable_lora=True, max_loras=2, max_lora_rank=16, block_size=16)  # fmt: skip
    assert all(layer.kernel_rank == 16 for layer in llm.engine.runner.lora.layers.values())  # type: ignore[union-attr]
    adapters = [small, big, None]
    requests = [None if a is None else LoRARequest(a.name, i + 1, str(a)) for i, a in enumerate(adapters)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=requests)
    for out, adapter, prompt in zip(outs, adapters, PROMPTS):
        assert out.outputs[0].token_ids == reference(base, adapter, prompt)
