"""Cascade (shared-prefix) decode attention equals plain attention; shared prefixes are found exactly."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention import torch_math as attention
from batchgen.engine.attention.cascade import cascade_decode_attention, cascade_len, shared_prefix_len
from batchgen.engine.cpu import decode_native
from batchgen.engine.cpu.decode_rows import DecodeRows


def test_cascade_equals_plain_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    b, kvh, g, d, shared, length = 5, 2, 3, 16, 24, 40
    k = torch.randn(b, kvh, length, d, generator=gen)
    v = torch.randn(b, kvh, length, d, generator=gen)
    k[:, :, :shared], v[:, :, :shared] = k[:1, :, :shared], v[:1, :, :shared]  # one shared prefix
    context = torch.tensor([25, 40, 31, 26, 38])  # every row has at least one own key
    mask = (torch.arange(length) < context[:, None])[:, None, None, :]  # [B, 1, 1, L]
    q = torch.randn(b, kvh * g, d, generator=gen)
    expected = F.scaled_dot_product_attention(q.reshape(b, kvh, g, d), k, v, attn_mask=mask, scale=0.2)
    got = cascade_decode_attention(q, k.transpose(-1, -2), v, shared, mask[..., shared:], 0.2)
    torch.testing.assert_close(got, expected.reshape(b, kvh * g, d), atol=1e-5, rtol=1e-5)


def test_shared_prefix_counts_only_identical_fully_cached_blocks() -> None:
    tables = [(7, 8, 9, 1), (7, 8, 9, 2), (7, 8, 5, 3)]
    assert shared_prefix_len(tables, [40, 40, 40], block_size=8) == 16
    assert shared_prefix_len(tables[:2], [40, 40], block_size=8) == 24
    assert shared_prefix_len(tables[:2], [40, 20], block_size=8) == 16  # block 9 not full for row 1
    assert shared_prefix_len(tables[:1], [40], block_size=8) == 0  # alone: nothing to share
    assert shared_prefix_len([(1, 2), (3, 2)], [16, 16], block_size=8) == 0  # same later block, not a prefix
    four = [(7, 8, 9, i) for i in range(4)]
    assert cascade_len(four, [30, 31, 30, 29], block_size=8, kv_len=32) == 24
    assert cascade_len(four[:3], [30, 31, 30], block_size=8, kv_len=32) == 0  # too few rows
    assert cascade_len(four, [30, 31, 30, 29], block_size=8, kv_len=64) == 0  # too small a share
    # past the cheap bound (24 cached of 32), but only block 7 is shared: 8 tokens, under the share
    assert cascade_len([(7, 8 + i, 9, i) for i in range(4)], [30, 31, 30, 29], block_size=8, kv_len=32) == 0


def test_engine_with_a_shared_preamble_uses_cascade_with_either_decode_source(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The split is decided from block tables, whichever source; the native kernel reads a shared
    prefix from the group's first row instead of splitting the softmax (decode_native)."""
    calls = []
    real = attention.cascade_decode_attention

    def counting(*args: object) -> torch.Tensor:
        calls.append(1)
        return real(*args)  # type: ignore[arg-type]

    real_attend, real_plan = decode_native.NativeStep.attend, decode_native.NativeStep.front_plan

    def native_counting(self: decode_native.NativeStep, *args: Any) -> None:
        calls.extend([1] if int(self.shared.max()) > 0 else [])
        real_attend(self, *args)

    def planned_counting(self: decode_native.NativeStep, *args: Any) -> decode_native.FrontPlan:
        calls.extend([1] if int(self.shared.max()) > 0 else [])  # a decode-only step: the C++ front attends
        return real_plan(self, *args)

    monkeypatch.setattr(attention, "cascade_decode_attention", counting)
    monkeypatch.setattr(decode_native.NativeStep, "attend", native_counting)
    monkeypatch.setattr(decode_native.NativeStep, "front_plan", planned_counting)
    preamble = [(7 * j) % 250 + 2 for j in range(64)]
    prompts = [preamble + [(i * 11 + j) % 250 + 2 for j in range(3 + i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = []
    for backend in ("cpu", "torch"):
        llm = LLM(str(tiny_model("llama")), block_size=8, num_kv_blocks=200, attention_backend=backend)
        assert isinstance(llm.engine.runner.backend.decode_kv, DecodeRows) is (backend == "cpu")  # float32: the kernel
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert calls, backend
        calls.clear()
    assert outputs[0] == outputs[1]
