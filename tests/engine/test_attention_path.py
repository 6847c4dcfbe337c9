"""The attention path choice (pure) and the varlen path's arguments, checked on CPU.

The kernel itself needs a GPU; here a reference of its documented contract (varlen_reference)
stands in for it, so everything the engine computes and passes (cu_seqlens, seqused_k, int32
block tables, the window as (left, right), the GQA flag) is checked against plain attention.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.attention import path as attention_path
from batchgen.engine.attention.gather import GatheredBlocks
from batchgen.engine.attention.interface import paged_attention_forward
from batchgen.engine.attention.path import (
    SDPA,
    VARLEN,
    KernelSupport,
    choose_attention_path,
    default_block_size,
    varlen_signature_ok,
)
from batchgen.engine.attention.planning import build_forward_context

from .attention_harness import CPU_STAGER, running
from .test_attention import BLOCK, DIM, HEADS, KV_HEADS, _chunk, _reference
from .varlen_reference import reference_varlen_attn

H100 = KernelSupport(varlen_paged=True, compute_capability=(9, 0))
BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "device, dtype, block, head_dim, softcap, support, path, reason",
    [
        ("cuda", BF16, 256, 128, False, H100, VARLEN, "no gather"),
        ("cuda", torch.float16, 512, 64, False, H100, VARLEN, "no gather"),
        ("cpu", BF16, 256, 128, False, H100, SDPA, "device cpu"),
        ("cuda", torch.float32, 256, 128, False, H100, SDPA, "float32"),
        ("cuda", BF16, 16, 128, False, H100, SDPA, "block_size 16"),
        ("cuda", BF16, 384, 128, False, H100, SDPA, "block_size 384"),
        ("cuda", BF16, 256, 128, True, H100, SDPA, "soft-capping"),
        ("cuda", BF16, 256, 12, False, H100, SDPA, "head_dim 12"),
        ("cuda", BF16, 256, 512, False, H100, SDPA, "head_dim 512"),
        ("cuda", BF16, 256, 128, False, KernelSupport(False, (9, 0)), SDPA, "no block_table"),
        ("cuda", BF16, 256, 128, False, KernelSupport(True, (7, 5)), SDPA, "compute capability"),
    ],
)
def test_the_path_and_its_reason(
    device: str,
    dtype: torch.dtype,
    block: int,
    head_dim: int,
    softcap: bool,
    support: KernelSupport,
    path: str,
    reason: str,
) -> None:
    choice = choose_attention_path(device, dtype, block, head_dim, softcap, support)
    assert choice.path == path and reason in choice.reason


def test_default_block_size_is_256_only_where_the_varlen_kernel_then_applies() -> None:
    assert default_block_size("cuda", BF16, 128, False, H100) == 256
    assert default_block_size("cuda", torch.float32, 128, False, H100) == 16
    assert default_block_size("cuda", BF16, 128, True, H100) == 16  # Gemma 2: soft-capping
    assert default_block_size("cpu", BF16, 128, False, H100) == 16


def test_signature_detection() -> None:
    def old_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1)):  # type: ignore[no-untyped-def]
        return query

    assert not varlen_signature_ok(old_varlen) and not varlen_signature_ok(None)
    assert varlen_signature_ok(reference_varlen_attn)


def _run_varlen(specs: list[tuple[int, int]], window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """specs: (cached context, new tokens) per sequence, every chunk through the varlen path."""
    monkeypatch.setattr(attention_path, "VARLEN_ATTN", reference_varlen_attn)
    gen = torch.Generator().manual_seed(1)
    num_blocks = sum(math.ceil((c + n) / BLOCK) for c, n in specs) + 2
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)  # garbage beyond the written slots
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    chunks, keys, values, queries = [], [], [], []
    for i, (ctx_len, n) in enumerate(specs):
        table = [free.pop() for _ in range(math.ceil((ctx_len + n) / BLOCK))]
        k = torch.randn(KV_HEADS, ctx_len + n, DIM, generator=gen)
        v = torch.randn(KV_HEADS, ctx_len + n, DIM, generator=gen)
        for pos in range(ctx_len):
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[:, pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[:, pos]
        chunks.append(_chunk(i, ctx_len, n, table, decode=n == 1))
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(HEADS, n, DIM, generator=gen))
    source = GatheredBlocks(BLOCK)
    ctx, _, order = build_forward_context(chunks, source, [(k_cache, v_cache)], BLOCK, CPU_STAGER, True)
    assert ctx.flash is not None and ctx.decodes is None and len(ctx.prefills) == sum(n > 1 for _, n in specs)
    assert order == list(range(len(specs)))  # nothing is reordered: no decode groups
    query = torch.cat(queries, dim=1)[None]  # [1, H, T, D]
    key = torch.cat([k[:, c:] for k, (c, _) in zip(keys, specs)], dim=1)[None]  # [1, KVH, T, D]
    value = torch.cat([v[:, c:] for v, (c, _) in zip(values, specs)], dim=1)[None]
    with running(ctx) as layer:
        out, _ = paged_attention_forward(layer, query, key, value, None, scaling=0.3, sliding_window=window)
    expected = torch.cat([_reference(q, k, v, 0.3, window, None) for q, k, v in zip(queries, keys, values)])
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_varlen_path_matches_plain_attention(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # decodes (fresh, at a block boundary, mid-block), fresh prefills, prefills over cached context
    _run_varlen([(0, 1), (8, 1), (13, 1), (0, 9), (5, 6), (8, 4), (2, 13)], window, monkeypatch)


def test_varlen_metadata() -> None:
    chunks = [_chunk(0, 5, 1, [3, 1], True), _chunk(1, 0, 6, [0, 2], False)]
    source = GatheredBlocks(BLOCK)
    caches = [(torch.zeros(4, BLOCK, KV_HEADS, DIM),) * 2]
    ctx, positions, _ = build_forward_context(chunks, source, caches, BLOCK, CPU_STAGER, True)
    meta = ctx.flash
    assert meta is not None
    assert meta.cu_seqlens_q.tolist() == [0, 1, 7] and meta.cu_seqlens_k.tolist() == [0, 6, 12]
    assert meta.seqused_k.tolist() == [6, 6] and (meta.max_seqlen_q, meta.max_seqlen_k) == (6, 6)
    assert meta.block_tables.tolist() == [[3, 1], [0, 2]]  # int64 as staged; cast to int32 at the kernel call
    assert positions.tolist() == [5, 0, 1, 2, 3, 4, 5]


def test_soft_capping_never_reaches_the_varlen_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_path, "VARLEN_ATTN", reference_varlen_attn)
    source = GatheredBlocks(BLOCK)
    caches = [(torch.zeros(2, BLOCK, KV_HEADS, DIM),) * 2]
    ctx, _, _ = build_forward_context([_chunk(0, 0, 2, [0], False)], source, caches, BLOCK, CPU_STAGER, True)
    qkv = torch.randn(1, HEADS, 2, DIM), torch.randn(1, KV_HEADS, 2, DIM), torch.randn(1, KV_HEADS, 2, DIM)
    with running(ctx) as layer, pytest.raises(RuntimeError, match="soft-caps"):
        paged_attention_forward(layer, *qkv, None, softcap=2.0)


def test_cpu_runner_takes_the_sdpa_path(tiny_model) -> None:  # type: ignore[no-untyped-def]
    from batchgen import LLM

    llm = LLM(str(tiny_model("llama")), device="cpu", num_kv_blocks=8)
    assert llm.engine.runner.attention.path == SDPA and not llm.engine.runner.flash


def test_soft_capping_is_read_from_the_config() -> None:
    from transformers import Gemma2Config, LlamaConfig

    from batchgen.engine.attention.path import has_softcap

    assert has_softcap(Gemma2Config(attn_logit_softcapping=50.0)) and not has_softcap(LlamaConfig())
