"""The paged attention function against plain attention on random tensors (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.attention import forward_context, paged_attention_forward
from batchgen.engine.model_runner import Chunk, build_forward_context

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer_idx = 0


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int | None,
               softcap: float | None) -> torch.Tensor:
    """q [H, n, D] (the last n positions), k/v [KVH, L, D] -> [n, H, D], eager math, K/V repeated."""
    n, total = q.shape[1], k.shape[1]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=0)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=0)
    scores = q @ k.transpose(-1, -2) * scaling  # [H, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(total - n, total)[:, None]
    kv_pos = torch.arange(total)[None]
    allowed = kv_pos <= q_pos
    if window is not None:
        allowed &= kv_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(0, 1)


def _run_case(specs: list[tuple[int, int]], window: int | None, softcap: float | None) -> None:
    """specs: (cached context, new tokens) per sequence, one-token chunks first."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(math.ceil((c + n) / BLOCK) for c, n in specs) + 3
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)  # garbage outside the written slots
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    chunks, full_k, full_v, queries = [], [], [], []
    for ctx_len, n in specs:
        total = ctx_len + n
        table = [free.pop() for _ in range(math.ceil(total / BLOCK))]
        k = torch.randn(KV_HEADS, total, DIM, generator=gen)
        v = torch.randn(KV_HEADS, total, DIM, generator=gen)
        for pos in range(ctx_len):  # the cached context is already in the pool
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[:, pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[:, pos]
        chunks.append(Chunk(ctx_len, n, table))
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(HEADS, n, DIM, generator=gen))
    ctx, positions = build_forward_context(chunks, [(k_cache, v_cache)], BLOCK, torch.device("cpu"))
    query = torch.cat(queries, dim=1)[None]  # [1, H, T, D]
    key = torch.cat([k[:, c:] for k, (c, _) in zip(full_k, specs)], dim=1)[None]  # [1, KVH, T, D]
    value = torch.cat([v[:, c:] for v, (c, _) in zip(full_v, specs)], dim=1)[None]
    with forward_context(ctx):
        out, _ = paged_attention_forward(_Layer(), query, key, value, None, scaling=0.3,
                                         sliding_window=window, softcap=softcap)
    expected = torch.cat([_reference(q, k, v, 0.3, window, softcap) for q, k, v in zip(queries, full_k, full_v)])
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    assert positions.tolist() == [p for c, n in specs for p in range(c, c + n)]


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_mixed_decode_and_prefill_with_context(window: int | None, softcap: float | None) -> None:
    specs = [(0, 1), (7, 1), (12, 1), (3, 1),  # decodes: fresh, mid-block, block boundary
             (0, 9), (5, 6), (8, 4), (2, 13)]  # prefill chunks: fresh and over cached context
    _run_case(specs, window, softcap)


def test_prefill_only_and_decode_only() -> None:
    _run_case([(0, 11)], None, None)
    _run_case([(15, 1), (0, 1), (30, 1)], None, None)


def test_new_kv_lands_in_the_slot_mapping() -> None:
    k_cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    ctx, _ = build_forward_context([Chunk(2, 3, [3, 1])], [(k_cache, v_cache)], BLOCK, torch.device("cpu"))
    assert ctx.slot_mapping.tolist() == [3 * BLOCK + 2, 3 * BLOCK + 3, 1 * BLOCK + 0]
    key = torch.randn(1, KV_HEADS, 3, DIM)
    with forward_context(ctx):
        paged_attention_forward(_Layer(), torch.randn(1, HEADS, 3, DIM), key, key.clone(), None)
    torch.testing.assert_close(k_cache[1, 0], key[0, :, 2])
    torch.testing.assert_close(k_cache[3, 2], key[0, :, 0])


def test_attention_sinks_are_refused() -> None:
    ctx, _ = build_forward_context([Chunk(0, 2, [0])], [(torch.zeros(1, BLOCK, 1, DIM),) * 2], BLOCK,
                                   torch.device("cpu"))
    with forward_context(ctx), pytest.raises(NotImplementedError, match="attention sinks"):
        paged_attention_forward(_Layer(), torch.randn(1, 1, 2, DIM), torch.randn(1, 1, 2, DIM),
                                torch.randn(1, 1, 2, DIM), None, s_aux=torch.zeros(1))


def test_outside_the_runner_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no forward context"):
        paged_attention_forward(_Layer(), torch.randn(1, 1, 2, DIM), torch.randn(1, 1, 2, DIM),
                                torch.randn(1, 1, 2, DIM), None)
