"""The rows of one length class of decode rows (cpu/decode_rows): RowPack, and which class a row takes.

Why a module of its own: DecodeRows plans each step over the rows; this is how they are stored. A
class c holds contexts up to MIN_CLASS_LEN * 2**c tokens, every layer's keys in the native kernel's
tiles of positions and values `[rows, kv_heads, class length, head_dim]`, allocated for every seat
at once (address space only). A freed row is a hole the next new row takes, so nothing moves.
"""

from __future__ import annotations

import heapq
import math

import torch

from batchgen.engine.cpu.native import TILE

MIN_CLASS_LEN = 64  # tokens held by the shortest class
FREE = -1  # a row that no sequence holds
MIN_ROWS = 8  # a class's first allocation when the number of rows is not bounded
ROW_GROWTH = 2  # then its row count doubles, so reallocation copies are amortized


def length_class(length: int) -> int:
    """The smallest class whose rows hold `length` tokens."""
    return 0 if length <= MIN_CLASS_LEN else math.ceil(math.log2(length / MIN_CLASS_LEN))


def row_class(length: int, max_len: int) -> int:
    """The class of a new row for a sequence of `length` tokens that may grow to `max_len` (0: unknown).

    Why one class ahead when the sequence can only end there: a prompt just below a class's length
    would otherwise be copied into a row twice within a few steps (a 500-token prompt with 16-64
    new tokens: filled at 500, refilled at 513; (b)'s row fills took 69 ms, now 34). Only one class,
    because a class's rows are reserved at once for every seat, and a long generation would
    reserve its longest class for its whole life; it moves up as before once it outgrows that.
    """
    here = length_class(length)
    return here + 1 if length_class(max_len) == here + 1 else here


class RowPack:
    """The rows of one length class: tensors (keys in the kernel's tiles), allocated for every seat
    at once (address space only), and which sequence holds which row (a freed row is a hole the
    next new row takes: the kernel reads each decode's own row, so nothing moves)."""

    def __init__(
        self,
        num_layers: int,
        shape_tail: tuple[int, int, int],  # (KVH, class length, D): a value row's shape
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int | None,
    ) -> None:
        self.num_layers, self.shape_tail, self.dtype, self.device = num_layers, shape_tail, dtype, device
        self.max_rows = max_rows
        self.k: list[torch.Tensor] = []  # per layer [rows, KVH, length / TILE, D, TILE] (see _grow)
        self.v: list[torch.Tensor] = []  # per layer [rows, KVH, length, D]
        self.seqs: list[int] = []  # seq id of each row (FREE: none)
        self.free: list[int] = []  # rows left by finished sequences, taken first

    def add(self, seq_id: int) -> int:
        """A row for `seq_id`. Why never zeroed: the native kernel reads no position at or past a
        row's length (keys nor values), so its padding is never read (zeroing it cost ~5% of (b))."""
        if self.free:
            row = heapq.heappop(self.free)
            self.seqs[row] = seq_id
            return row
        row = len(self.seqs)
        if not self.k or row == self.k[0].shape[0]:
            # why all max_rows at once: `empty` only reserves address space (pages are touched on
            # first use), so growing in steps would copy for nothing
            self._grow(max(row + 1, self.max_rows or max(MIN_ROWS, ROW_GROWTH * row)))
        self.seqs.append(seq_id)
        return row

    def remove(self, row: int) -> None:
        """Free `row`, a hole for the next new row. Why not moved into by the last row: the kernel
        reads each decode's own row, and a move copied the last row's whole context in every layer
        (~0.2 ms a finished sequence in (b))."""
        self.seqs[row] = FREE
        heapq.heappush(self.free, row)

    def _grow(self, rows: int) -> None:
        """Room for `rows` rows. Why keys in tiles of TILE positions x D (decode_attention.c): a tile
        is then one contiguous run, one stream to the prefetcher instead of D (decode attention of
        the 57M model, head dim 64: 22.0 -> 19.0 ms for 4 layers of 64 rows, RESULTS.md, fourth pass)."""
        kvh, length, d = self.shape_tail
        have = self.k[0].shape[0] if self.k else 0
        new_k = [self._empty(rows, kvh, length // TILE, d, TILE) for _ in range(self.num_layers)]
        new_v = [self._empty(rows, kvh, length, d) for _ in range(self.num_layers)]
        for old, new in zip(self.k + self.v, new_k + new_v):
            new[:have] = old
        self.k, self.v = new_k, new_v

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)
