"""RowPack: the rows of one length class of decode rows (cpu/decode_rows): tensors and who holds which row.

Why apart: how a class's rows are laid out (keys transposed for the torch math, in the native
kernel's tiles otherwise), allocated (all seats at once, address space only), zeroed (only what a
fill will not write, only where the torch math reads it) and freed (the last row moves into a
hole for the torch math; the kernel's packs keep the hole) is one concern, and DecodeRows, which
decides which sequence holds which row, is another.
"""

from __future__ import annotations

import heapq

import torch

from batchgen.engine.cpu.native import TILE

FREE = -1  # a tiled pack's row that no sequence holds
MIN_ROWS = 8  # a class's first allocation when the number of rows is not bounded
ROW_GROWTH = 2  # then its row count doubles, so reallocation copies are amortized


class RowPack:
    """The rows of one length class: tensors and which sequence holds which row."""

    def __init__(
        self,
        num_layers: int,
        shape_tail: tuple[int, int, int],  # (KVH, class length, D): a value row's shape
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int | None,
        tiled: bool = False,
        transposed: bool | None = None,
    ) -> None:
        self.num_layers, self.shape_tail, self.dtype, self.device = num_layers, shape_tail, dtype, device
        self.max_rows = max_rows
        self.tiled = tiled  # keys in the native kernel's tiles (see _keys)
        # keys stored [D, length] (None: float32 alone; bf16 where measured faster: cpu/decode_layout)
        self.transposed = dtype == torch.float32 if transposed is None else transposed
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.seqs: list[int] = []  # seq id of each row (FREE: none, tiled packs only)
        self.free: list[int] = []  # tiled packs: rows left by finished sequences, taken first
        self.zeroed = 0  # rows 0..zeroed-1 hold finite values (see add)

    def add(self, seq_id: int, filled: int) -> int:
        """A row for `seq_id`, whose positions 0..filled-1 the step's fill will write."""
        if self.free:
            row = heapq.heappop(self.free)
            self.seqs[row] = seq_id
            return row
        row = len(self.seqs)
        if not self.k or row == self.k[0].shape[0]:
            # why all max_rows at once: `empty` only reserves address space (pages are touched on
            # first use), so growing in steps would copy for nothing
            self._grow(max(row + 1, self.max_rows or max(MIN_ROWS, ROW_GROWTH * row)))
        if row >= self.zeroed and not self.tiled:
            # why: masked positions still enter the torch attention's arithmetic (0 * NaN is NaN),
            # so a row's padding must hold finite values; a used row's stale K/V are finite, fresh
            # memory may not be. Only the part the fill will not write is zeroed, on first use
            # (a step that fails mid-fill can leave garbage behind: a NaN there reaches the
            # logits and fails the engine's NaN check, it cannot pass silently). Why not tiled
            # rows: the native kernel reads no position at or past a row's length (keys nor
            # values), so their padding is never read (zeroing it cost ~5% of workload (b)).
            for k, v in zip(self.k, self.v):
                k[row, ..., filled:].zero_()
                v[row, :, filled:].zero_()
            self.zeroed = row + 1
        self.seqs.append(seq_id)
        return row

    def remove(self, row: int, moved_len: int) -> int | None:
        """Free `row`; the last row (with `moved_len` tokens) moves into it. Returns the moved seq.

        Tiled packs (the native kernel's) keep the hole instead, for the next row to take, and move
        nothing: the kernel reads each decode's own row, and a move copied the last row's whole
        context in every layer (~0.2 ms a finished sequence in (b))."""
        if self.tiled:
            self.seqs[row] = FREE
            heapq.heappush(self.free, row)
            return None
        last = self.seqs.pop()
        if row == len(self.seqs):
            return None
        for k, v in zip(self.k, self.v):
            k[row, ..., :moved_len] = k[len(self.seqs), ..., :moved_len]
            v[row, :, :moved_len] = v[len(self.seqs), :, :moved_len]
        self.seqs[row] = last
        return last

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _keys(self, rows: int, kvh: int, d: int, length: int) -> torch.Tensor:
        """Key rows, indexed [rows, KVH, D, length] whatever their storage; tiled, [rows, KVH,
        length / TILE, D, TILE] for the native kernel (decode_attention.c).

        Why float32 is stored transposed: its attention is two batched products that read keys
        along positions (attention._batched_decode_attention); in bfloat16 those were slower on an
        Intel CPU than SDPA over [length, D] keys, and 10-20x faster on an AMD one, so bf16's
        layout is measured per machine (cpu/decode_layout) and handed in as `transposed`.
        Why tiles for the kernel: a tile of TILE positions x D keys is then one contiguous run,
        one stream to the prefetcher instead of D (decode attention of the 57M model, head dim
        64: 22.0 -> 19.0 ms for 4 layers of 64 rows, benchmarks/RESULTS.md, fourth pass).
        """
        if self.tiled:
            return self._empty(rows, kvh, length // TILE, d, TILE)
        if self.transposed:
            return self._empty(rows, kvh, d, length)
        return self._empty(rows, kvh, length, d).transpose(-1, -2)

    def _grow(self, rows: int) -> None:
        kvh, length, d = self.shape_tail
        have = self.k[0].shape[0] if self.k else 0
        new_k = [self._keys(rows, kvh, d, length) for _ in range(self.num_layers)]
        new_v = [self._empty(rows, kvh, length, d) for _ in range(self.num_layers)]
        for old, new in zip(self.k + self.v, new_k + new_v):
            new[:have] = old
        self.k, self.v = new_k, new_v
