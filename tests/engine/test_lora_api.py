"""LoRA through the vLLM-style API: error rows for adapters that cannot run, compiled forwards,
chat, and vLLM's import path."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM, LoRARequest
from batchgen.engine.api.params import SamplingParams
from testkit.tiny_lora import merged_model, save_tiny_adapter
from testkit.tiny_models import EOS_ID

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def build_adapters(base: Path, folder: Path) -> tuple[Path, Path, Path]:
    """(base, a rank-4 adapter of q/v/down, a rank-16 adapter of q/v)."""
    small = save_tiny_adapter(base, folder / "small", r=4, target_modules=("q_proj", "v_proj", "down_proj"))
    big = save_tiny_adapter(base, folder / "big", r=16, seed=3)
    return base, small, big


@pytest.fixture(scope="module")
def setup(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return build_adapters(tiny_model("llama"), tmp_path_factory.mktemp("lora-api"))


def reference(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    model = merged_model(base, adapter)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                             eos_token_id=EOS_ID, pad_token_id=EOS_ID)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_an_adapter_that_cannot_run_is_an_error_row(setup: tuple[Path, Path, Path], tmp_path: Path) -> None:
    base, small, big = setup
    llm = LLM(str(base), device="cpu", dtype="float32", compile=False, enable_lora=True, max_loras=2, max_lora_rank=8)
    dora = save_tiny_adapter(base, tmp_path / "dora", use_dora=True)
    requests = [
        LoRARequest("small", 1, str(small)),
        LoRARequest("big", 2, str(big)),  # rank 16 > max_lora_rank 8
        LoRARequest("gone", 3, str(tmp_path / "gone")),
        LoRARequest("dora", 4, str(dora)),
        None,
    ]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 5, GREEDY, lora_request=requests)
    assert outs[0].error is None and outs[0].outputs[0].token_ids == reference(base, small, PROMPTS[0])
    assert outs[1].error is not None and "adapter 'big'" in outs[1].error and "above max_lora_rank 8" in outs[1].error
    assert outs[2].error is not None and "adapter 'gone'" in outs[2].error and "is not a folder" in outs[2].error
    assert outs[3].error is not None and "use_dora=true is not supported" in outs[3].error
    assert outs[4].error is None and outs[4].outputs[0].token_ids == reference(base, None, PROMPTS[0])
    assert llm.stats["errors"] == 3


def test_compiled_forward_with_adapters(setup: tuple[Path, Path, Path]) -> None:
    """torch.compile around the wrapped linears: the same tokens as the merged models."""
    base, small, big = setup
    llm = LLM(str(base), device="cpu", dtype="float32", compile=True, enable_lora=True, max_loras=2,
              max_lora_rank=16, max_num_batched_tokens=64, block_size=16)  # fmt: skip
    adapters = [small, big, None]
    requests = [None if a is None else LoRARequest(a.name, i + 1, str(a)) for i, a in enumerate(adapters)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=requests)
    for out, adapter, prompt in zip(outs, adapters, PROMPTS):
        assert out.outputs[0].token_ids == reference(base, adapter, prompt)
    assert llm.engine.runner.forward.stats.graphs >= 1


def test_chat_takes_one_lora_request_for_all(setup: tuple[Path, Path, Path]) -> None:
    base, small, _ = setup
    llm = LLM(str(base), device="cpu", dtype="float32", compile=False, enable_lora=True)
    llm.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    request = LoRARequest("small", 1, str(small))
    conversations = [[{"role": "user", "content": "w5 w6 w7"}], [{"role": "user", "content": "w20 w21"}]]
    outs = llm.chat(conversations, GREEDY, lora_request=request)
    assert [o.outputs[0].token_ids for o in outs] == [
        reference(base, small, [5, 6, 7]),
        reference(base, small, [20, 21]),
    ]


def test_vllm_import_path_is_batchgen_s(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen.vllm_compat import install, uninstall

    install()
    try:
        from vllm.lora.request import LoRARequest as VllmLoRARequest

        assert VllmLoRARequest is LoRARequest
        request = VllmLoRARequest("x", 7, "/a")
        assert (request.name, request.adapter_id, request.path) == ("x", 7, "/a")
        assert request == LoRARequest("x", 8, "/b")  # vLLM's rule: the name is the identity
    finally:
        uninstall()
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("x", 0, "/a")


def test_pooling_with_adapters_is_refused_by_name(setup: tuple[Path, Path, Path]) -> None:
    base, small, _ = setup
    with pytest.raises(
        ValueError, match=r"LLM\(task='embed', enable_lora=True\): LoRA adapters serve task 'generate' only"
    ):
        LLM(str(base), device="cpu", task="embed", enable_lora=True)
    llm = LLM(str(base), device="cpu", dtype="float32", compile=False, enable_lora=True)
    with pytest.raises(NotImplementedError, match="LoRA adapters serve generation only, not pooling"):
        llm.embed("w5 w6", lora_request=LoRARequest("small", 1, str(small)))
