"""Planning a step for the attention: the packed order of its chunks and the metadata every layer reads.

Decodes first, in their K/V source's order (a few padded groups), then the other chunks in batch
order; every tensor is staged for the step's one upload (staging/transfers).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Protocol

import torch

from batchgen.engine.attention.decode_kv import DecodeKVSource, DecodeRequest, DecodeStep, Stage, padded_tables
from batchgen.engine.attention.kv_store import PAD_SLOT
from batchgen.engine.attention.metadata import FlashMetadata, ForwardContext, PrefillChunk
from batchgen.engine.staging.transfers import Transfers


class PlannedChunk(Protocol):
    """What planning reads of a scheduled chunk (core/scheduler_output.ScheduledChunk is one; why a
    Protocol: core stands above attention, so attention names what it reads instead of importing it)."""

    @property
    def seq_id(self) -> int: ...
    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def block_table(self) -> Sequence[int]: ...
    @property
    def is_decode(self) -> bool: ...
    @property
    def max_len(self) -> int: ...


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """Python ints -> a 1-D int64 CPU tensor (why an array: ~1.8 us for 64 ints, torch.tensor ~10.7 us)."""
    if not values:  # why: frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _packed_order(
    chunks: Sequence[PlannedChunk],
    decode_kv: DecodeKVSource,
    flash: bool,
    stage: Stage,
) -> tuple[list[int], DecodeStep | None, int]:
    """Chunk indices in packed order (decodes as their source plans them, then the rest in batch
    order), the decodes' step and their number. With the varlen kernel every chunk reads the pool:
    nothing is planned."""
    decodes = [] if flash else [i for i, c in enumerate(chunks) if c.is_decode]
    if not decodes:
        return list(range(len(chunks))), None, 0
    packed, step = decode_kv.plan(
        [
            # why max_len: the decode rows size a row for the longest it may grow
            DecodeRequest(chunks[i].seq_id, chunks[i].start, chunks[i].block_table, chunks[i].max_len)
            for i in decodes
        ],
        stage,
    )
    rest = [i for i, c in enumerate(chunks) if not c.is_decode]
    return [decodes[j] for j in packed] + rest, step, len(decodes)


def build_forward_context(
    chunks: Sequence[PlannedChunk],
    decode_kv: DecodeKVSource,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    transfers: Transfers,
    flash: bool = False,
    padded_len: int | None = None,
) -> tuple[ForwardContext, torch.Tensor, list[int]]:
    """Step metadata for `chunks` (batch order) -> (context, positions [T], packed order of the chunks).

    `padded_len` >= the step's tokens pads positions (0) and the slot mapping (-1, not stored).
    """
    order, step, num_dec = _packed_order(chunks, decode_kv, flash, transfers.stage)
    packed = [chunks[i] for i in order]
    needed = [math.ceil((c.start + c.num_tokens) / block_size) for c in packed]
    short = [order[j] for j, (c, n) in enumerate(zip(packed, needed)) if len(c.block_table) < n]
    if short:  # why: a missing block would silently alias block 0 (another sequence's K/V)
        raise RuntimeError(f"chunks {short[:5]} have fewer KV blocks than their tokens need")
    if num_dec == len(packed):  # decodes only (never with the varlen kernel, which plans none)
        positions, slots = decode_slots(packed, block_size, padded_len)
        ctx = ForwardContext(kv_caches, transfers.stage(slots), step, [], num_tokens=len(packed))
        return ctx, transfers.stage(positions), order
    max_blocks = max(needed)
    tables = padded_tables([c.block_table for c in packed], needed, max_blocks)  # [N, max_blocks]
    lens = int64_tensor([c.num_tokens for c in packed])  # [N]
    ctx_start = int64_tensor([c.start for c in packed])  # [N]
    cu = torch.cumsum(lens, 0) - lens  # [N] packed offset of each chunk
    num_tokens = int(cu[-1] + lens[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(packed)), lens)  # [T]
    positions = torch.arange(num_tokens) - cu[seq_of_token] + ctx_start[seq_of_token]  # [T]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size  # [T]
    pad = (padded_len or num_tokens) - num_tokens
    if pad > 0:
        positions = torch.cat([positions, positions.new_zeros(pad)])
        slots = torch.cat([slots, slots.new_full((pad,), PAD_SLOT)])
    meta = _flash_metadata(lens, ctx_start, tables, transfers) if flash else None
    starts = cu.tolist()
    prefills = [
        PrefillChunk(
            start=starts[j],
            end=starts[j] + c.num_tokens,
            context_start=c.start,
            # why the staged tables' rows with the varlen kernel: no per-chunk copies (its attention reads none)
            block_table=transfers.stage(tables[j, : needed[j]]) if meta is None else meta.block_tables[j],
        )
        for j, c in enumerate(packed)
        if not c.is_decode
    ]
    ctx = ForwardContext(
        kv_caches=kv_caches,
        slot_mapping=transfers.stage(slots),
        decodes=step,
        prefills=prefills,
        flash=meta,
        num_tokens=num_tokens,
    )
    return ctx, transfers.stage(positions), order


def decode_slots(
    decodes: Sequence[PlannedChunk], block_size: int, padded_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token chunks -> (positions [T], slot mapping [T]), padded as build_forward_context pads
    (why lists: cheaper than the general path's tensor ops, ~0.3 ms of a 64-row CPU step)."""
    positions = [c.start for c in decodes]
    slots = [c.block_table[p // block_size] * block_size + p % block_size for c, p in zip(decodes, positions)]
    pad = (padded_len or len(positions)) - len(positions)
    return int64_tensor(positions + [0] * pad), int64_tensor(slots + [PAD_SLOT] * pad)


def _flash_metadata(
    lens: torch.Tensor, ctx_start: torch.Tensor, tables: torch.Tensor, transfers: Transfers
) -> FlashMetadata:
    """lens/ctx_start [N] (packed order), tables [N, max_blocks] -> the varlen kernel's metadata
    (int64 as staged; the kernel's call casts to int32 after the upload)."""
    zero = torch.zeros(1, dtype=torch.int64)
    kv_lens = ctx_start + lens  # [N] keys each chunk attends over: its cached context and itself
    return FlashMetadata(
        cu_seqlens_q=transfers.stage(torch.cat([zero, torch.cumsum(lens, 0)])),
        cu_seqlens_k=transfers.stage(torch.cat([zero, torch.cumsum(kv_lens, 0)])),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(kv_lens.max()),
        block_tables=transfers.stage(tables),
        seqused_k=transfers.stage(kv_lens),
    )
