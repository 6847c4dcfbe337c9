"""DecodeRows: the decode K/V source that keeps a contiguous copy of each decoding sequence's K/V.

Why: on CPU a decode step is memory-bound. Gathering every sequence's blocks out of the paged
pool each step copies its whole context per layer, and attention then reads the copy again. Here
a decoding sequence holds a row of per-layer tensors, filled once from its blocks; each step
appends one token per layer, and attention reads the rows as views. The paged pool stays the
source of truth (prefix caching, preemption): it is written exactly as before, a row is only a
copy of it, and a row that is out of step with its sequence is dropped and refilled.

Rows come in length classes (class c holds contexts up to MIN_CLASS_LEN * 2**c tokens), one
pack of tensors per class (keys in the native kernel's tiles of positions, values `[rows, kv_heads,
class length, head_dim]`: cpu/row_pack), so a short sequence is padded only to its class, never to the
longest sequence. A sequence that outgrows its class is refilled into the next one (a copy of its
context, about twice over its whole life, instead of once per step); one that can only end within
the next class starts there (row_class). A step's decodes are packed by (class, row); the kernel is
handed each decode's row, so a freed row stays a hole until a new sequence takes it. Rows are freed
when the engine says their sequences finished or were preempted (`release`), and when a row is
found out of step with its sequence's next decode. The native kernel attends every decode (the cpu
backend exists only where it can: cpu/backend); elsewhere the torch backend gathers blocks instead.

A step's plan is a RowsView (a DecodeStep, see decode_kv): which rows to fill from the pool first
(sequences new to their length class), and the kernel's plan (decode_native).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from batchgen.engine.attention.cascade import shared_prefix_len
from batchgen.engine.attention.decode_kv import QKV, DecodeRequest, Pool, Stage
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.cpu.decode_native import ClassRows, NativeStep, Scratch, fill_row
from batchgen.engine.cpu.native import TILE
from batchgen.engine.cpu.row_pack import MIN_CLASS_LEN, RowPack, row_class


@dataclass
class RowsView:
    """One step's rows: its decodes' length classes in packed order, and the kernel's plan of them."""

    classes: list[ClassRows]
    native: NativeStep
    writes_pool = True  # a decode-only step's K/V are stored in the pool by the kernel (attend)

    def attend(self, call: LayerCall, pool: Pool, qkv: QKV, out: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Fill new rows, then append and attend every decode in one call, storing the step's K/V in
        the pool too when given their `slots` (a decode-only step).

        q [H, T, D], key/value [KVH, T, D] (decodes first), out [T, H, D].
        """
        if call.softcap is not None:  # why: cpu/backend.kernel_attends gives no soft-capping model the kernel
            raise RuntimeError("the native decode kernel cannot soft-cap attention logits")
        self._fill(call.layer, pool)
        self.native.attend(call.layer, *qkv, out, call.scale, call.window, pool if slots is not None else None, slots)

    def fill_all(self, pools: list[Pool]) -> None:
        """Copy every layer's new rows out of the pool now, before the forward (one pool per layer).

        Only for a decode-only step: every position a row is filled with was computed in an earlier
        step, so nothing this step writes to the pool is missing (see _fill)."""
        for layer, pool in enumerate(pools):
            self._fill(layer, pool)
        for step in self.classes:
            step.fills = []

    def _fill(self, layer: int, pool: Pool) -> None:
        """Copy new rows' context out of the pool.

        Why per layer, after the layer's K/V went to the pool: a new row's blocks may be matched
        prefix blocks that another sequence computes in this very step.
        """
        for step in self.classes:
            k, v = step.k[layer], step.v[layer]
            for row, length, blocks in step.fills:
                fill_row(pool, blocks, length, k[row], v[row])


@dataclass
class _Repeat:
    """The last step's native plan, for a step that repeats it one position on (DecodeRows.plan)."""

    seq_ids: list[int]  # its decodes' sequences, in the order plan() was given them
    limits: list[int]  # the positions each one's row holds (its class length)
    order: list[int]  # the packed order plan() returned
    members: list[list[int]]  # per class, in packed order: indices of its decodes
    step: NativeStep  # its classes hold each class's row tensors


class DecodeRows:
    """Every decoding sequence's row, by length class; plans each step's rows (a DecodeKVSource)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int | None = None,
        pool_tokens: int | None = None,
    ) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.max_len = max_len  # no sequence is longer: caps the longest class
        self.max_rows = max_rows  # no step has more decodes: caps every class's rows
        self.pool_tokens = pool_tokens  # the pool holds no more: caps the rows of long classes
        self.dtype, self.device = dtype, device
        self._packs: dict[int, RowPack] = {}
        self._where: dict[int, tuple[int, int]] = {}  # seq id -> (class, row)
        self._len_of: dict[int, int] = {}  # tokens held in the row (positions 0..len-1)
        self.num_fills = 0  # rows filled from the pool (for tests and the benchmark)
        self._scratch = Scratch()
        self._repeat: _Repeat | None = None  # the last native plan (see _repeated)

    def plan(self, decodes: list[DecodeRequest], stage: Stage) -> tuple[list[int], RowsView]:
        """Rows for this step's decodes -> (their packed order as indices into `decodes`, the view).

        A row is kept when its sequence decodes again at the next position in the same class;
        otherwise it is released, and the sequence gets a new row filled from the pool. Why the
        check stays beside `release`: a step that failed mid-forward, or a sequence preempted and
        recomputed, leaves a row out of step with its sequence, and it must be refilled.
        """
        repeated = self._repeated(decodes)
        if repeated is not None:
            return repeated
        self._repeat = None
        wanted = {d.seq_id: d for d in decodes}
        # why only this step's sequences: finished and preempted ones were released by the engine
        # (release), and one that sits a step out (a budget-limited step) keeps its row
        for seq_id in [s for s in self._where if s in wanted and not self._in_step(s, wanted[s])]:
            self._release(seq_id)
        fills: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for d in decodes:
            if d.seq_id not in self._where:
                self._assign(d, fills, stage)
            # why now: the forward appends this step's token; a failed step is caught by the
            # length check next time (the position will not have advanced), and refilled
            self._len_of[d.seq_id] = d.position + 1
        order = sorted(range(len(decodes)), key=lambda i: self._where[decodes[i].seq_id])
        by_class: dict[int, list[DecodeRequest]] = {}
        for i in order:
            by_class.setdefault(self._where[decodes[i].seq_id][0], []).append(decodes[i])
        packs = [self._packs[c] for c in by_class]
        classes = [ClassRows(p.k, p.v, len(ds), fills=fills.get(c, [])) for p, (c, ds) in zip(packs, by_class.items())]
        view = RowsView(classes, self._native_step(classes, list(by_class.values())))
        self._remember(decodes, order, view)
        return order, view

    def _repeated(self, decodes: list[DecodeRequest]) -> tuple[list[int], RowsView] | None:
        """The last native plan one position on, when this step is that step's decodes in the same
        order, each at the position after it and still within its row: what the full plan would
        find (every row kept, none filled, the same order and classes), without its per-sequence
        dictionaries, sort and table. Why: in a long decode nearly every step is such a step, and
        the full plan cost ~0.18 ms of a 64-sequence CPU step. None: plan it in full."""
        last = self._repeat
        if last is None or len(decodes) != len(last.seq_ids) or len(self._where) != len(decodes):
            return None
        len_of = self._len_of
        for d, seq_id, limit in zip(decodes, last.seq_ids, last.limits):
            if d.seq_id != seq_id or len_of[seq_id] != d.position or d.position >= limit:
                return None
        for d in decodes:
            len_of[d.seq_id] = d.position + 1
        groups = [[decodes[i] for i in members] for members in last.members]
        last.step.advance([d.position + 1 for ds in groups for d in ds], [self._shared(ds) for ds in groups])
        for part in last.step.classes:
            part.fills = []  # why: filled in the step that planned them
        return last.order, RowsView(list(last.step.classes), last.step)

    def _remember(self, decodes: list[DecodeRequest], order: list[int], view: RowsView) -> None:
        """Keep this native plan for a next step that repeats it (_repeated)."""
        where = [self._where[d.seq_id] for d in decodes]
        members: dict[int, list[int]] = {}
        for i in order:
            members.setdefault(where[i][0], []).append(i)
        self._repeat = _Repeat(
            seq_ids=[d.seq_id for d in decodes],
            limits=[MIN_CLASS_LEN << c for c, _ in where],
            order=order,
            members=list(members.values()),
            step=view.native,
        )

    def _native_step(self, classes: list[ClassRows], decodes: list[list[DecodeRequest]]) -> NativeStep:
        """The kernel's view of the step: each class's rows, and what every decode attends to.

        Why every shared prefix, not only cascade's (decode_kv.make_group): the kernel reads a shared
        prefix from the class's first row at no extra cost, so any length of it saves reads."""
        for part, ds in zip(classes, decodes):
            part.shared, part.rows = self._shared(ds), [self._where[d.seq_id][1] for d in ds]
        return NativeStep(classes, [d.position + 1 for ds in decodes for d in ds], self._scratch)

    def _shared(self, decodes: list[DecodeRequest]) -> int:
        """Positions that every decode of a class holds in the very same, fully cached blocks."""
        if len(decodes) < 2:
            return 0
        return shared_prefix_len([d.block_table for d in decodes], [d.position for d in decodes], self.block_size)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Free the rows of finished or preempted sequences (ids without a row are ignored).

        Why explicit (the scheduler's diff, through ModelRunner.apply): a row used to be freed when
        its sequence was absent from a step, which could not tell a finished sequence from one that
        merely sat a step out, and kept a finished one's row until the next plan."""
        for seq_id in seq_ids:
            if seq_id in self._where:
                self._release(seq_id)
                self._repeat = None  # why: the repeated plan names this sequence

    def reset(self) -> None:
        """Release every row (a reset follows a failed step); the tensors stay allocated."""
        self._where.clear()
        self._len_of.clear()
        self._repeat = None
        for pack in self._packs.values():
            pack.seqs.clear()
            pack.free.clear()

    def _class_rows(self, c: int) -> int | None:
        """Most rows class c can ever need: seats, and what the pool can hold at the class's lengths.

        Why: the rows of a class are reserved at once (address space only), and a long class with
        many seats could ask for more than the machine has, although the pool never holds that much.
        """
        if self.max_rows is None or self.pool_tokens is None or c == 0:
            return self.max_rows
        # every sequence in class c holds at least this many (see row_class: one class early)
        shortest = (MIN_CLASS_LEN << (c - 2)) + 1 if c > 1 else 1
        return min(self.max_rows, self.pool_tokens // shortest + 1)

    def _in_step(self, seq_id: int, d: DecodeRequest) -> bool:
        """Its row holds positions 0..d.position-1 and still fits the next one.

        Why `position < class length` stands for `length_class(position + 1) == class`: a row only
        ever grows from a position its class was chosen for, so it cannot have fallen below it."""
        return self._len_of[seq_id] == d.position and d.position < MIN_CLASS_LEN << self._where[seq_id][0]

    def _assign(self, d: DecodeRequest, fills: dict[int, list[tuple[int, int, torch.Tensor]]], stage: Stage) -> None:
        c = row_class(d.position + 1, min(d.max_len, self.max_len))
        if c not in self._packs:
            length = min(MIN_CLASS_LEN << c, max(self.max_len, d.position + 1))
            length = -(-length // TILE) * TILE  # why: the kernel's keys come in whole tiles
            shape = (self.num_kv_heads, length, self.head_dim)
            self._packs[c] = RowPack(self.num_layers, shape, self.dtype, self.device, self._class_rows(c))
        row = self._packs[c].add(d.seq_id)
        self._where[d.seq_id] = (c, row)
        self.num_fills += 1
        if d.position > 0:
            blocks = stage(torch.tensor(d.block_table[: math.ceil(d.position / self.block_size)]))
            fills.setdefault(c, []).append((row, d.position, blocks))

    def _release(self, seq_id: int) -> None:
        c, row = self._where.pop(seq_id)
        del self._len_of[seq_id]
        self._packs[c].remove(row)
