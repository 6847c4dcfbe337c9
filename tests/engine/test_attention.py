"""The paged attention function against plain attention on random tensors (CPU), with either decode K/V source."""

from __future__ import annotations

import math

import pytest
import torch

from batchgen.engine.attention.decode_kv import DecodeKVSource
from batchgen.engine.attention.gather import GatheredBlocks
from batchgen.engine.attention.interface import paged_attention_forward
from batchgen.engine.attention.metadata import ForwardContext
from batchgen.engine.attention.planning import build_forward_context
from batchgen.engine.core.scheduler_output import ScheduledChunk
from batchgen.engine.cpu import native
from batchgen.engine.cpu.decode_rows import DecodeRows, RowsView

from .attention_harness import CPU_STAGER, Layer, running

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float, window: int | None, softcap: float | None
) -> torch.Tensor:
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


# rows: the native kernel attends float32 and bf16 decodes (decode_native), never soft-capped ones (the
# cpu backend makes the torch backend for those: cpu/backend.make_cpu_backend)
SOURCES = ["gather", "rows"]


def _source(kind: str, dtype: torch.dtype = torch.float32) -> DecodeKVSource:
    """As the model runner builds them (cpu/backend.kernel_attends: the kernel for float32 or bf16; here
    bf16 takes it whether or not it measured faster)."""
    if kind == "rows":
        assert native.load() is not None, "the native kernel did not build"
        return DecodeRows(
            num_layers=1,
            num_kv_heads=KV_HEADS,
            head_dim=DIM,
            block_size=BLOCK,
            max_len=256,
            dtype=dtype,
            device=torch.device("cpu"),
        )
    return GatheredBlocks(BLOCK)


def _chunk(seq_id: int, start: int, n: int, table: list[int], decode: bool) -> ScheduledChunk:
    return ScheduledChunk(
        seq_id=seq_id, start=start, token_ids=(2,) * n, block_table=tuple(table), needs_sample=True, is_decode=decode
    )


def _run_case(
    specs: list[tuple[int, int]],
    window: int | None,
    softcap: float | None,
    decode_kv: str,
    shared: int = 0,
    dtype: torch.dtype = torch.float32,
) -> ForwardContext:
    """specs: (cached context, new tokens) per sequence; a one-token chunk is a decode unless its
    context is odd. The first `shared` tokens (whole blocks) are the same blocks in every sequence.
    The reference runs in float32 on the same (rounded) values."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(math.ceil((c + n) / BLOCK) for c, n in specs) + 3
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)  # garbage outside the written slots
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, out-of-order blocks
    prefix_blocks = [free.pop() for _ in range(shared // BLOCK)]
    prefix_k, prefix_v = torch.randn(2, KV_HEADS, shared, DIM, generator=gen)
    chunks, full_k, full_v, queries = [], [], [], []
    for i, (ctx_len, n) in enumerate(specs):
        total = ctx_len + n
        table = prefix_blocks + [free.pop() for _ in range(math.ceil(total / BLOCK) - len(prefix_blocks))]
        k = torch.randn(KV_HEADS, total, DIM, generator=gen)
        v = torch.randn(KV_HEADS, total, DIM, generator=gen)
        k[:, :shared], v[:, :shared] = prefix_k, prefix_v
        for pos in range(ctx_len):  # the cached context is already in the pool
            k_cache[table[pos // BLOCK], pos % BLOCK] = k[:, pos]
            v_cache[table[pos // BLOCK], pos % BLOCK] = v[:, pos]
        chunks.append(_chunk(i, ctx_len, n, table, decode=n == 1 and ctx_len % 2 == 0))
        full_k.append(k)
        full_v.append(v)
        queries.append(torch.randn(HEADS, n, DIM, generator=gen))
    rounded = [[t.to(dtype) for t in ts] for ts in (full_k, full_v, queries)]
    full_k, full_v, queries = ([t.float() for t in ts] for ts in rounded)
    pool = (k_cache.to(dtype), v_cache.to(dtype))
    ctx, positions, order = build_forward_context(chunks, _source(decode_kv, dtype), [pool], BLOCK, CPU_STAGER)
    query = torch.cat([rounded[2][i] for i in order], dim=1)[None]  # [1, H, T, D], packed order
    key = torch.cat([rounded[0][i][:, specs[i][0] :] for i in order], dim=1)[None]  # [1, KVH, T, D]
    value = torch.cat([rounded[1][i][:, specs[i][0] :] for i in order], dim=1)[None]
    with running(ctx) as layer:
        out, _ = paged_attention_forward(
            layer, query, key, value, None, scaling=0.3, sliding_window=window, softcap=softcap
        )
    expected = torch.cat([_reference(queries[i], full_k[i], full_v[i], 0.3, window, softcap) for i in order])
    # every new token's K/V is in the pool at its slot, whoever stored it (the native kernel, on decode-only steps)
    slots = ctx.slot_mapping.tolist()
    torch.testing.assert_close(pool[0].flatten(0, 1)[slots], key[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(pool[1].flatten(0, 1)[slots], value[0].transpose(0, 1), atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out[0].float(), expected, atol=tol, rtol=tol)
    assert positions.tolist() == [p for i in order for p in range(specs[i][0], sum(specs[i]))]
    decodes = {i for i, c in enumerate(chunks) if c.is_decode}
    assert set(order[: len(decodes)]) == decodes  # decodes are packed first
    if decodes and decode_kv == "rows":
        assert isinstance(ctx.decodes, RowsView)
        assert ctx.decodes.native.calls == 1  # the kernel attended this layer's decodes
    return ctx


@pytest.mark.parametrize("decode_kv, softcap", [("gather", None), ("gather", 2.0), ("rows", None)])
@pytest.mark.parametrize("window", [None, 5])
def test_mixed_decode_and_prefill_with_context(window: int | None, softcap: float | None, decode_kv: str) -> None:
    specs = [
        (0, 1),
        (8, 1),
        (12, 1),
        (2, 1),  # decodes: fresh, block boundary, mid-block
        (9, 1),  # a one-token chunk that is not a decode (e.g. a chunked prompt's last token)
        (0, 9),
        (5, 6),
        (8, 4),
        (2, 13),
    ]  # prefill chunks: fresh and over cached context
    _run_case(specs, window, softcap, decode_kv)


@pytest.mark.parametrize("decode_kv", SOURCES)
@pytest.mark.parametrize("window", [None, 5])
def test_bfloat16_attends_as_float32_does(window: int | None, decode_kv: str) -> None:
    specs = [(16, 1), (0, 1), (30, 1), (9, 1), (5, 6)]
    for dtype in (torch.bfloat16, torch.float32):
        _run_case(specs, window, None, decode_kv, dtype=dtype)


@pytest.mark.parametrize("decode_kv", SOURCES)
def test_prefill_only_and_decode_only(decode_kv: str) -> None:
    _run_case([(0, 11)], None, None, decode_kv)
    _run_case([(16, 1), (0, 1), (30, 1)], None, None, decode_kv)


@pytest.mark.parametrize("decode_kv", SOURCES)
def test_decodes_sharing_cached_blocks_use_cascade_with_either_source(decode_kv: str) -> None:
    ctx = _run_case([(20, 1), (22, 1), (24, 1), (26, 1)], None, None, decode_kv, shared=16)
    assert ctx.decodes is not None
    if isinstance(ctx.decodes, RowsView):  # read from the first row
        assert ctx.decodes.native.shared.tolist() == [16] * 4
    else:
        assert [g.shared_len for g in ctx.decodes.groups] == [16]


def test_decode_rows_refuse_a_soft_capped_layer() -> None:
    """The cpu backend never gives a soft-capping model its rows (kernel_attends); a layer that soft-caps
    anyway is an error, never a silent wrong answer."""
    with pytest.raises(RuntimeError, match="cannot soft-cap"):
        _run_case([(16, 1), (0, 1)], None, 2.0, "rows")


def test_new_kv_lands_in_the_slot_mapping() -> None:
    k_cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros(4, BLOCK, KV_HEADS, DIM)
    ctx, _, _ = build_forward_context(
        [_chunk(0, 2, 3, [3, 1], False)], _source("gather"), [(k_cache, v_cache)], BLOCK, CPU_STAGER
    )
    assert ctx.slot_mapping.tolist() == [3 * BLOCK + 2, 3 * BLOCK + 3, 1 * BLOCK + 0]
    key = torch.randn(1, KV_HEADS, 3, DIM)
    with running(ctx) as layer:
        paged_attention_forward(layer, torch.randn(1, HEADS, 3, DIM), key, key.clone(), None)
    torch.testing.assert_close(k_cache[1, 0], key[0, :, 2])
    torch.testing.assert_close(k_cache[3, 2], key[0, :, 0])


@pytest.mark.parametrize("decode_kv", SOURCES)
def test_a_decode_only_step_gets_the_slots_the_general_path_gives(decode_kv: str) -> None:
    """Decode-only steps build their metadata in Python (decode_slots); a step with one prefill
    chunk more runs the general tensor path: the decodes' positions and slots must agree."""
    caches = [(torch.zeros(24, BLOCK, KV_HEADS, DIM),) * 2]
    decodes = [
        _chunk(i, start, 1, table, True) for i, (start, table) in enumerate([(0, [5]), (4, [2, 9]), (7, [1, 3])])
    ]
    mixed = [*decodes, _chunk(9, 2, 5, [7, 8], False)]
    ctx, positions, order = build_forward_context(decodes, _source(decode_kv), caches, BLOCK, CPU_STAGER, padded_len=8)
    ctx_mixed, positions_mixed, order_mixed = build_forward_context(
        mixed, _source(decode_kv), caches, BLOCK, CPU_STAGER
    )
    assert order == order_mixed[:3] and ctx.num_tokens == 3 and ctx.prefills == []
    assert positions.tolist()[:3] == positions_mixed.tolist()[:3] and positions.tolist()[3:] == [0] * 5
    assert ctx.slot_mapping.tolist()[:3] == ctx_mixed.slot_mapping.tolist()[:3]
    assert ctx.slot_mapping.tolist()[3:] == [-1] * 5  # padding goes to the trash block


def test_attention_sinks_are_refused() -> None:
    ctx, _, _ = build_forward_context(
        [_chunk(0, 0, 2, [0], False)],
        _source("gather"),
        [(torch.zeros(1, BLOCK, 1, DIM),) * 2],
        BLOCK,
        CPU_STAGER,
    )
    with running(ctx) as layer, pytest.raises(NotImplementedError, match="attention sinks"):
        paged_attention_forward(
            layer,
            torch.randn(1, 1, 2, DIM),
            torch.randn(1, 1, 2, DIM),
            torch.randn(1, 1, 2, DIM),
            None,
            s_aux=torch.zeros(1),
        )


def test_outside_the_runner_is_an_error() -> None:
    qkv = [torch.randn(1, 1, 2, DIM) for _ in range(3)]
    with pytest.raises(RuntimeError, match="not bound to a KV pool layer"):
        paged_attention_forward(Layer(), *qkv, None)
    ctx, _, _ = build_forward_context(
        [_chunk(0, 0, 2, [0], False)],
        _source("gather"),
        [(torch.zeros(1, BLOCK, 1, DIM),) * 2],
        BLOCK,
        CPU_STAGER,
    )
    with running(ctx) as layer:
        pass
    with pytest.raises(RuntimeError, match="outside a step"):  # bound, but its backend has no step planned
        paged_attention_forward(layer, *qkv, None)
