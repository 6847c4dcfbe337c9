"""The native decode kernel's view of one step's decode rows: where they are, how long, what they share.

Why a module: the kernel (csrc/decode_attention.c, loaded by native.py) reads each decode's row
through raw addresses, so a step hands it each decode's length class and row, per layer where
each class's key and value tensors start and how far apart their rows are, each row's class
length (the stride between positions) and how many positions it attends to, and how many of
them its class holds in shared cached blocks (read from the class's first row). This is built
once per step from the rows' classes (decode_rows) and read by every layer; the kernel then
appends the step's K/V and attends all decodes in one call per layer, with no padding to a
group's longest row and no Python per group.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from batchgen.engine.cpu import native

PROFILE_NAME = "batchgen::native_decode_attention"  # what torch's profiler shows for a kernel call


@dataclass
class ClassRows:
    """One length class's part of a step, as decode_rows plans it: its decodes' rows, in packed order."""

    k: list[torch.Tensor]  # per layer [rows, KVH, cap / TILE, D, TILE] (keys in tiles of positions: RowPack)
    v: list[torch.Tensor]  # per layer [rows, KVH, cap, D]
    num_rows: int  # decodes of the class in this step
    # positions every decode's row holds in the same blocks (0: none), read from the lowest of the rows
    shared: int = 0
    rows: Sequence[int] | None = None  # each decode's row of the tensors (None: 0..num_rows-1)
    fills: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)  # (row, length, blocks) to fill first

    def decode_rows(self) -> Sequence[int]:
        return range(self.num_rows) if self.rows is None else self.rows

    @property
    def cap(self) -> int:
        """Positions a row holds (its class length)."""
        return self.v[0].shape[2]


class Scratch:
    """The kernel's per-thread score rows, kept across steps and grown as needed."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.float32)

    def get(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=torch.float32)
        return self.buffer


_MODEL_AT, _LAYER_AT = native.ARG["kvh"], native.ARG["q"]  # where the kernel's shape and per-layer arguments start
_LAYER_ARGS = len(native.DECODE_ARGS) - _LAYER_AT


class NativeStep:
    """Every decode's row, length and shared prefix, and each layer's class tensors, for one step."""

    def __init__(self, classes: Sequence[ClassRows], lengths: Sequence[int], scratch: Scratch) -> None:
        """lengths: positions each decode attends to after this step's token (packed order)."""
        self.calls = 0  # layers attended (for tests and the benchmark)
        # the step's classes in packed order (why kept: the table below holds raw addresses into their tensors)
        self.classes = classes
        self._kvh, self._d, self.dtype = _row_shape(classes)
        self._kernel = native.attention("batchgen_decode_attention", self.dtype)  # the float32 or the bf16 one
        n, num_classes, num_layers = len(lengths), len(classes), len(classes[0].k)
        rows = sum(part.num_rows for part in classes)
        if len(lengths) != rows:
            raise RuntimeError(f"native decode attention: {len(lengths)} lengths for {rows} rows")
        self.num_decodes = n
        # One int64 table for the whole step, which the kernel reads through addresses into it:
        # per decode its class, row, class length, length and shared prefix; per class the floats
        # between key rows and between value rows; per layer and class where the key and value
        # tensors start. Why one array: torch.tensor() over Python lists costs ~0.3 us an element,
        # and each layer then only adds offsets to one address (no tensor ops per layer).
        # rows counted from each class's lowest, where its tensors' addresses point: the kernel
        # reads a shared prefix from there (a row of this step, so its positions are filled)
        low = [min(part.decode_rows(), default=0) for part in classes]
        table = _per_row(range(num_classes), classes)
        table.extend([r - low[c] for c, part in enumerate(classes) for r in part.decode_rows()])
        table.extend(_per_row([part.cap for part in classes], classes))
        table.extend(lengths)
        table.extend(_per_row([part.shared for part in classes], classes))
        table.extend([t.stride(0) for t in [p.k[0] for p in classes] + [p.v[0] for p in classes]])
        for tensors in ([p.k for p in classes], [p.v for p in classes]):
            table.extend(
                [
                    t[layer].data_ptr() + low[c] * t[layer].stride(0) * t[layer].element_size()
                    for layer in range(num_layers)
                    for c, t in enumerate(tensors)
                ]
            )
        # per class: its tensors' rows from the lowest on (the kernel checks each decode's row against it)
        table.extend([part.k[0].shape[0] - low[c] for c, part in enumerate(classes)])
        # why kept: advance() rewrites it in place (it cannot be resized while the tensor shares it)
        self._table = table
        self.table = torch.frombuffer(table, dtype=torch.int64)
        at, size = self.table.data_ptr(), self.table.element_size()
        strides = at + 5 * n * size
        self._bases = strides + 2 * num_classes * size  # [key | value, layers, classes]
        self._layer_bytes, self._num_layers = num_classes * size, num_layers
        # The kernel's arguments (native.DECODE_ARGS), in three parts: what holds for the step is
        # set here, the model's shapes on the first call, each layer's tensors on every call
        self._args = array("q", bytes(8 * len(native.DECODE_ARGS)))
        rows_at = self._bases + 2 * num_layers * num_classes * size
        self._args[:_MODEL_AT] = array(
            "q",
            [n, native.threads(), strides, strides + num_classes * size, *(at + i * n * size for i in range(5))]
            + [num_classes, rows_at],
        )
        self._args_at = self._args.buffer_info()[0]
        self._longest = -(-max(lengths) // native.TILE) * native.TILE
        self._scratch, self._heads = scratch, 0

    def advance(self, lengths: Sequence[int], shared: Sequence[int]) -> None:
        """The same decodes in the same rows one step on: each one's length (packed order) and each
        class's shared prefix anew; every class, row and address stays as it was checked and laid
        out, so the table is rewritten in place (decode_rows reuses a step for the next one). Why
        through the array: two slice copies into the table tensor cost ~40 us of the step here."""
        n, classes = self.num_decodes, self.classes
        if len(lengths) != n or len(shared) != len(classes):
            raise RuntimeError(f"native decode attention: {len(lengths)} lengths, {len(shared)} shared prefixes")
        for part, value in zip(classes, shared):
            part.shared = value
        self._table[3 * n : 4 * n] = array("q", lengths)
        self._table[4 * n : 5 * n] = _per_row(shared, classes)
        self._args[native.ARG["threads"]] = native.threads()
        self._longest = -(-max(lengths) // native.TILE) * native.TILE
        self._heads, self.calls = 0, 0  # the next call sizes the scratch for the new longest row

    @property
    def shared(self) -> torch.Tensor:
        """[n] each decode's shared prefix (positions read from its class's first row)."""
        n = self.num_decodes
        return self.table[4 * n : 5 * n]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
        pool: tuple[torch.Tensor, torch.Tensor] | None = None,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Append the decodes' key/value to the rows and attend their queries into out's first n rows.

        q [H, T, D], key/value [KVH, T, D] (any strides with D contiguous; the decodes are tokens
        0..n-1 of the T), out [>= n, H, D] contiguous, all on the CPU in the rows' dtype (float32 or
        bfloat16: NativeStep.dtype); with `pool` (K, V
        [blocks, block_size, KVH, D], contiguous) and `slots` [>= n] int64, the K/V are stored in
        those pool slots too.
        """
        n, kvh, d = self.num_decodes, self._kvh, self._d
        h, tokens = q.shape[0], q.shape[1]
        # why checked here: the kernel reads and writes through raw addresses, so a wrong shape,
        # stride, dtype or device would corrupt memory instead of raising
        if (
            q.dim() != 3 or q.shape[2] != d or h % kvh or key.shape != (kvh, tokens, d) or value.shape != key.shape
            or tokens < n or out.shape[0] < n or out.shape[1:] != (h, d)
        ):  # fmt: skip
            raise RuntimeError(
                f"native decode attention: q {tuple(q.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}, "
                f"out {tuple(out.shape)} for {n} decodes over rows of {kvh} KV heads x {d}"
            )
        if not (q.dtype == key.dtype == value.dtype == out.dtype == self.dtype) or not out.is_contiguous():
            raise RuntimeError(f"native decode attention needs {self.dtype} tensors and a contiguous output")
        if not (q.is_cpu and key.is_cpu and value.is_cpu and out.is_cpu):
            raise RuntimeError(f"native decode attention runs on the CPU, got q on {q.device}")
        if q.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
            q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
        if h != self._heads:  # the step's first call: the model's shapes and the scratch they need
            self._set_heads(h)
        k_bases = self._bases + layer * self._layer_bytes
        stores = _pool_stores(pool, slots, n, kvh, d, self.dtype)
        per_layer = array(
            "q",
            [
                q.data_ptr(), *q.stride()[:2], key.data_ptr(), *key.stride()[:2], value.data_ptr(),
                *value.stride()[:2], k_bases, k_bases + self._num_layers * self._layer_bytes, window or 0,
                out.data_ptr(), *stores,
            ],
        )  # fmt: skip
        if len(per_layer) != _LAYER_ARGS:  # why: a slice assignment of another length would move the array
            raise RuntimeError(f"native decode attention: {len(per_layer)} per-layer arguments, not {_LAYER_ARGS}")
        self._args[_LAYER_AT:] = per_layer
        # why named for the profiler: a ctypes call is invisible to profiles otherwise (only while one
        # runs: a record_function costs ~5 us even when none does)
        named = torch._C._autograd._profiler_enabled()
        with torch.profiler.record_function(PROFILE_NAME) if named else nullcontext():
            status = self._kernel(self._args_at, scale)
        self.calls += 1
        if status == -1:
            raise RuntimeError(f"native decode attention refused {h // kvh} query heads per KV head, head dim {d}")
        if status == -3:
            raise MemoryError(f"native decode attention: no memory for the work list of {n} decodes")
        if status != 0:
            raise RuntimeError(
                "native decode attention refused a decode longer than its row, a shared prefix not shorter "
                "than its decode, or a slot outside the pool"
            )

    def _set_heads(self, h: int) -> None:
        """The kernel's model arguments for h query heads, and scratch rows for them."""
        g = h // self._kvh
        per_thread = native.MAX_BLOCK * g * self._longest  # score rows for a block of decodes
        scratch = self._scratch.get(self._args[native.ARG["threads"]] * per_thread)
        self._args[_MODEL_AT:_LAYER_AT] = array("q", [self._kvh, g, self._d, scratch.data_ptr(), per_thread])
        self._heads = h

    def front_plan(
        self, pools: Sequence[tuple[torch.Tensor, torch.Tensor]], slots: torch.Tensor, heads: int, tokens: int
    ) -> FrontPlan:
        """The plan of a decode-only step for the C++ front (csrc/attention_op.cpp): every layer's call
        then attends there, with the K/V stored in `pools` (per layer K, V [blocks, block_size, KVH,
        D]) at `slots` [>= n] int64. `tokens`: the step's real tokens (the output rows past them
        are zeroed)."""
        n, kvh, d = self.num_decodes, self._kvh, self._d
        same = all(_is_pool(pool, kvh, d, self.dtype) and pool[0].shape == pools[0][0].shape for pool in pools)
        if len(pools) != self._num_layers or heads % kvh or not same:
            raise RuntimeError(f"native decode attention: {len(pools)} pools, {heads} heads for rows of {kvh} x {d}")
        _check_slots(slots, n)
        self._set_heads(heads)
        k0 = pools[0][0]  # every layer's pool has its shape
        fields = {
            "args": self._args_at, "layers": self._num_layers, "decodes": n, "tokens": tokens,
            "heads": heads, "kv_heads": kvh, "head_dim": d, "bases": self._bases, "layer_bytes": self._layer_bytes,
            "slots": slots.data_ptr(), "pool_slots": k0.shape[0] * k0.shape[1], "calls": 0, "nanos": 0,
            "kernel": ctypes.cast(self._kernel, ctypes.c_void_p).value or 0, "bf16": int(self.dtype == torch.bfloat16),
        }  # fmt: skip
        plan = array("q", [fields[name] for name in PLAN_FIELDS])
        plan.extend([t.data_ptr() for pool in pools for t in pool])
        return FrontPlan(plan, (self, list(pools), slots))


@dataclass
class FrontPlan:
    """A decode-only step's plan for the C++ front, and what its addresses point into."""

    fields: array  # PLAN_FIELDS in order, then each layer's key pool and value pool
    keep: tuple[object, ...]  # the step (its table and arguments), the pools, the slots: alive while it is

    @property
    def calls(self) -> int:
        return self.fields[PLAN_CALLS]

    @property
    def kernel_seconds(self) -> float:
        return self.fields[PLAN_NANOS] * 1e-9


# The C++ front's plan, in the order of its P_* fields (csrc/decode_args.h), then the pools; the
# operator's library names them too, and attention_front refuses one whose names differ
PLAN_FIELDS = (
    "args", "layers", "decodes", "tokens", "heads", "kv_heads", "head_dim", "bases", "layer_bytes",
    "slots", "pool_slots", "calls", "nanos", "kernel", "bf16",
)  # fmt: skip
PLAN_CALLS, PLAN_NANOS = PLAN_FIELDS.index("calls"), PLAN_FIELDS.index("nanos")


def _per_row(values: Sequence[int], classes: Sequence[ClassRows]) -> array:
    """One value per class -> that value for each of the class's rows (why not per row: a property
    read and a list element per row cost ~90 us of a 64-row step)."""
    out = array("q")
    for value, part in zip(values, classes):
        out.extend(array("q", [value]) * part.num_rows)
    return out


def _row_shape(classes: Sequence[ClassRows]) -> tuple[int, int, torch.dtype]:
    """(KVH, D, dtype) of the classes' rows, once every layer's tensors are what the kernel addresses:
    one dtype the kernels read (float32 or bfloat16) on the CPU, keys [rows, KVH, cap / TILE, D, TILE]
    and values [rows, KVH, cap, D], each row contiguous, the same shape and strides in every layer,
    each decode's row among them."""
    shapes = set()
    dtype = classes[0].k[0].dtype
    if dtype not in native.KERNEL_DTYPES:
        raise RuntimeError(f"native decode attention: rows of {dtype}")
    for part in classes:
        k0, v0 = part.k[0], part.v[0]
        if k0.dim() != 5 or v0.dim() != 4:
            raise RuntimeError(f"native decode attention: rows of {tuple(k0.shape)} and {tuple(v0.shape)}")
        rows, kvh, tiles, d, tile = k0.shape
        cap, used = tiles * tile, part.decode_rows()
        row_k, row_v = (tiles * d * tile, d * tile, tile, 1), (cap * d, d, 1)
        if not (
            tile == native.TILE and v0.shape == (rows, kvh, cap, d) and len(used) == part.num_rows
            and (not used or (min(used) >= 0 and max(used) < rows))
            and k0.stride()[1:] == row_k and v0.stride()[1:] == row_v
            and all(t.shape == k0.shape and t.stride() == k0.stride() and t.dtype == dtype and t.is_cpu
                    for t in part.k)
            and all(t.shape == v0.shape and t.stride() == v0.stride() and t.dtype == dtype and t.is_cpu
                    for t in part.v)
        ):  # fmt: skip
            raise RuntimeError(
                f"native decode attention: a class of {part.num_rows} rows, keys {tuple(k0.shape)} "
                f"{k0.stride()}, values {tuple(v0.shape)} {v0.stride()}"
            )
        shapes.add((kvh, d))
    if len(shapes) != 1:
        raise RuntimeError(f"native decode attention: classes of different row shapes {sorted(shapes)}")
    kvh, d = shapes.pop()
    return kvh, d, dtype


def _pool_stores(
    pool: tuple[torch.Tensor, torch.Tensor] | None,
    slots: torch.Tensor | None,
    n: int,
    kvh: int,
    d: int,
    dtype: torch.dtype,
) -> tuple[int, int, int, int]:
    """The kernel's pool arguments (key pool, value pool, slots, pool slots); zeros: no store."""
    if pool is None or slots is None:
        return (0, 0, 0, 0)
    k, v = pool
    if not _is_pool(pool, kvh, d, dtype):
        raise RuntimeError(
            f"native decode attention: a pool of {tuple(k.shape)} / {tuple(v.shape)} for {kvh} x {d} K/V"
        )
    _check_slots(slots, n)
    return (k.data_ptr(), v.data_ptr(), slots.data_ptr(), k.shape[0] * k.shape[1])


def _check_slots(slots: torch.Tensor, n: int) -> None:
    """`slots` is what the kernel reads as n decodes' pool slots: [>= n] int64, contiguous, on the CPU."""
    if not (slots.dim() == 1 and slots.shape[0] >= n and slots.dtype == torch.int64 and slots.is_contiguous()):
        raise RuntimeError(f"native decode attention: slots {slots.dtype} {tuple(slots.shape)} for {n} decodes")
    if not slots.is_cpu:
        raise RuntimeError(f"native decode attention: slots on {slots.device}")


def _is_pool(pool: tuple[torch.Tensor, torch.Tensor], kvh: int, d: int, dtype: torch.dtype) -> bool:
    """K and V are one layer's pool as the kernels address it: [blocks, block_size, kvh, d] each,
    of `dtype`, contiguous, on the CPU."""
    k, v = pool
    return (
        k.dim() == 4 and k.shape[2:] == (kvh, d) and v.shape == k.shape and k.dtype == v.dtype == dtype
        and k.is_contiguous() and v.is_contiguous() and k.is_cpu and v.is_cpu
    )  # fmt: skip


def fill_row(
    pool: tuple[torch.Tensor, torch.Tensor],
    blocks: torch.Tensor,
    length: int,
    k_row: torch.Tensor,
    v_row: torch.Tensor,
) -> None:
    """Copy positions 0..length-1 of one layer out of its pool (K, V [blocks, block_size, KVH, D])
    into a decode row: keys k_row [KVH, cap / TILE, D, TILE] (the kernel's tiles; the rest of the
    last tile zeroed), values v_row [KVH, cap, D]; `blocks` [>= ceil(length / block_size)] int64
    holds the sequence's blocks in order. Pool and row: float32, or bfloat16 (the bf16 kernel)."""
    k, v = pool
    kvh, cap, d = v_row.shape
    # why checked here: the kernel reads and writes through raw addresses
    if not (
        k.dtype in native.KERNEL_DTYPES and _is_pool(pool, kvh, d, k.dtype)
        and k_row.shape == (kvh, cap // native.TILE, d, native.TILE)
        and all(t.dtype == k.dtype and t.is_contiguous() and t.is_cpu for t in (k_row, v_row))
        and blocks.dim() == 1 and blocks.dtype == torch.int64 and blocks.is_contiguous() and blocks.is_cpu
    ):  # fmt: skip
        raise RuntimeError(
            f"native row fill: pool {tuple(k.shape)} / {tuple(v.shape)}, row keys {tuple(k_row.shape)}, "
            f"values {tuple(v_row.shape)}, blocks {blocks.dtype} {tuple(blocks.shape)}"
        )
    fill = native.attention("batchgen_fill_row", k.dtype)
    ptrs = (k.data_ptr(), v.data_ptr(), k.shape[0], k.shape[1], kvh, d, blocks.data_ptr(), blocks.shape[0], length)
    if fill(*ptrs, k_row.data_ptr(), v_row.data_ptr(), cap, native.threads()) != 0:
        raise RuntimeError(
            f"native row fill refused {length} positions from {blocks.shape[0]} blocks of {k.shape[1]} "
            f"(a pool of {k.shape[0]}) into a row of {cap}"
        )
