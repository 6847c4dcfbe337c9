"""The Triton backend's step metadata: what its kernels read, planned once per step, staged in one upload.

The varlen metadata attention/planning builds (every chunk read from the pool) plus the kernel's
tile map: each tile's chunk and first token; `rows` per tile is DECODE_ROWS on decode-only steps,
else PREFILL_ROWS. A graph-replayed decode step of B rows is planned from fixed buffers only
(`GraphRows.plan`: the first B rows of cuda/graphs' DecodeBuffers and constant slices made once at
the largest bucket), so the grid and every pointer are the same at every replay.

The context lists the step's prefill chunks (their packed span and cached context; the kernel reads
none of it) so that a vision-language step can mark the images in them whose tokens attend both
ways (Gemma 3); the first layer turns those marks into the kernel's per-token key bounds
(`image_key_ends`), once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchgen.engine.attention.metadata import ForwardContext, PrefillChunk, StaticDecode
from batchgen.engine.attention.planning import int64_tensor

DECODE_ROWS = 16
PREFILL_ROWS = 64


@dataclass
class KernelPlan:
    """What the attention kernel reads for one step (device tensors, int64)."""

    query_start: torch.Tensor  # [chunks + 1] packed offset of each chunk's first query, then the total
    kv_lens: torch.Tensor  # [chunks] keys each chunk attends over: its cached context + its own tokens
    block_tables: torch.Tensor  # [chunks, W] pool blocks of each chunk's sequence (padding: block 0, never read)
    tile_chunk: torch.Tensor  # [tiles] the chunk of each tile of the grid
    tile_first: torch.Tensor  # [tiles] the tile's first token, within its chunk
    group: int  # query heads per KV head
    rows: int  # (token, query head) rows of a tile: a power of two >= 16 and >= group; rows // group tokens


@dataclass
class TritonContext(ForwardContext):
    """A ForwardContext with the Triton kernel's plan (the varlen and decode fields stay unset)."""

    kernel: KernelPlan | None = None
    key_ends: torch.Tensor | None = None  # [T] image_key_ends of the step, made by its first layer
    key_ends_made: bool = False


def image_key_ends(prefills: Sequence[PrefillChunk], num_rows: int, device: torch.device) -> torch.Tensor | None:
    """Per packed token [num_rows] int64: for a token inside an image whose tokens attend both ways,
    one past the image's last position (the keys it sees: below max(its position + 1, this)); else
    0. None: no such image in the step. Made on the device (slice fills, no host copy)."""
    marked = [(p, first, end) for p in prefills for first, end in p.bidirectional]
    if not marked:
        return None
    out = torch.zeros(num_rows, dtype=torch.int64, device=device)
    for p, first, end in marked:  # positions [first, end) -> packed rows of this chunk
        lo = max(first, p.context_start) - p.context_start + p.start
        hi = min(end, p.context_start + p.end - p.start) - p.context_start + p.start
        if hi > lo:
            out[lo:hi] = end
    return out


def tile_rows(group: int, decode_only: bool) -> int:
    """Rows of a tile for `group` query heads per KV head: at least one token's heads, a power of two."""
    rows = DECODE_ROWS if decode_only else PREFILL_ROWS
    while rows < group:
        rows *= 2
    return rows


def tile_map(q_lens: Sequence[int], tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query lengths of the chunks (packed order) -> (chunk of each tile [tiles], its first token [tiles])."""
    chunks: list[int] = []
    firsts: list[int] = []
    for i, n in enumerate(q_lens):
        starts = range(0, n, tokens_per_tile)
        chunks.extend([i] * len(starts))
        firsts.extend(starts)
    return int64_tensor(chunks), int64_tensor(firsts)


class GraphRows:
    """The constant buffers of graph-replayed decode steps (see the module docstring), made once."""

    def __init__(self, max_rows: int, group: int, device: torch.device) -> None:
        self.arange = torch.arange(max_rows + 1, dtype=torch.int64, device=device)  # [max_rows + 1]
        self.zeros = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [max_rows]
        self.group = group

    def plan(self, static: StaticDecode) -> KernelPlan:
        """The kernel's plan of a decode step of B rows whose tables and lengths are in `static` ([B] rows)."""
        b = static.context_lens.shape[0]
        if b > self.zeros.shape[0]:
            raise RuntimeError(f"a graph decode step of {b} rows; the triton backend has buffers for {len(self.zeros)}")
        return KernelPlan(
            query_start=self.arange[: b + 1],
            kv_lens=static.context_lens,
            block_tables=static.block_tables,
            tile_chunk=self.arange[:b],
            tile_first=self.zeros[:b],
            group=self.group,
            rows=tile_rows(self.group, decode_only=True),
        )
