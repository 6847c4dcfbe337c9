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

from array import array
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from batchgen.engine import native
from batchgen.engine.attention_path import has_softcap
from batchgen.engine.models import kv_spec
from batchgen.engine.native import NativeKernels

PROFILE_NAME = "batchgen::native_decode_attention"  # what torch's profiler shows for a kernel call


@dataclass
class NativeClass:
    """One length class's part of a step, as decode_rows plans it: rows 0..n-1, in packed order."""

    k: list[torch.Tensor]  # per layer [rows, KVH, cap / TILE, D, TILE] (keys in tiles of positions)
    v: list[torch.Tensor]  # per layer [rows, KVH, cap, D]
    num_rows: int
    shared: int  # positions every row holds in the same blocks (0: none), read from row 0

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


class NativeStep:
    """Every decode's row, length and shared prefix, and each layer's class tensors, for one step."""

    def __init__(
        self, kernels: NativeKernels, classes: Sequence[NativeClass], lengths: Sequence[int], scratch: Scratch
    ) -> None:
        """lengths: positions each decode attends to after this step's token (packed order)."""
        self.kernels = kernels
        self.calls = 0  # layers attended (for tests and the benchmark)
        n, num_classes, num_layers = len(lengths), len(classes), len(classes[0].k)
        self.num_decodes = n
        # One int64 table for the whole step, which the kernel reads through addresses into it:
        # per decode its class, row, class length, length and shared prefix; per class the floats
        # between key rows and between value rows; per layer and class where the key and value
        # tensors start. Why one array: torch.tensor() over Python lists costs ~0.3 us an element,
        # and each layer then only adds offsets to one address (no tensor ops per layer).
        table = array("q", [c for c, part in enumerate(classes) for _ in range(part.num_rows)])
        table.extend([r for part in classes for r in range(part.num_rows)])
        table.extend([part.cap for part in classes for _ in range(part.num_rows)])
        table.extend(lengths)
        table.extend([part.shared for part in classes for _ in range(part.num_rows)])
        table.extend([t.stride(0) for t in [p.k[0] for p in classes] + [p.v[0] for p in classes]])
        table.extend([p.k[layer].data_ptr() for layer in range(num_layers) for p in classes])
        table.extend([p.v[layer].data_ptr() for layer in range(num_layers) for p in classes])
        self.table = torch.frombuffer(table, dtype=torch.int64)
        self.lengths = self.table[3 * n : 4 * n]  # [n]
        self.shared = self.table[4 * n : 5 * n]  # [n]
        at, size = self.table.data_ptr(), self.table.element_size()
        strides = at + 5 * n * size
        self._bases = strides + 2 * num_classes * size  # [key | value, layers, classes]
        self._layer_bytes, self._num_layers = num_classes * size, num_layers
        # The kernel's arguments (native.DECODE_ARGS): what holds for the whole step is set here,
        # each layer's call sets only its tensors' addresses and strides (see attend)
        threads = native.threads()
        longest = -(-max(lengths) // native.TILE) * native.TILE
        self._args = array("q", bytes(8 * len(native.DECODE_ARGS)))
        self._scratch, self._longest = scratch, longest
        for name, value in (
            ("n", n), ("threads", threads), ("kstride", strides), ("vstride", strides + num_classes * size),
            *((name, at + i * n * size) for i, name in enumerate(("cls", "row", "cap", "len", "shared"))),
        ):  # fmt: skip
            self._args[native.ARG[name]] = value
        self._args_at = self._args.buffer_info()[0]

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
        """Append the decodes' key/value to the rows and attend their queries into out [n, H, D].

        q [H, T, D], key/value [KVH, T, D] (any strides with D contiguous; the decodes are tokens
        0..n-1 of the T), all float32, out contiguous; with `pool` (K, V [blocks, block_size, KVH,
        D], contiguous) and `slots` [>= n] int64, the K/V are stored in those pool slots too.
        """
        n, args, arg = self.num_decodes, self._args, native.ARG
        h, tokens, d = q.shape
        kvh = key.shape[0]
        g = h // kvh
        # why checked here: the kernel reads and writes through raw addresses, so a wrong shape,
        # stride or dtype would corrupt memory instead of raising
        if (
            key.shape != (kvh, tokens, d) or value.shape != key.shape or tokens < n
            or out.shape[0] < n or out.shape[1:] != (h, d) or h % kvh
        ):  # fmt: skip
            raise RuntimeError(
                f"native decode attention: q {tuple(q.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}, out {tuple(out.shape)} for {n} decodes"
            )
        if not (q.dtype == key.dtype == value.dtype == out.dtype == torch.float32) or not out.is_contiguous():
            raise RuntimeError("native decode attention needs float32 tensors and a contiguous output")
        if q.stride(2) != 1 or key.stride(2) != 1 or value.stride(2) != 1:
            q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
        scratch = self._scratch.get(args[arg["threads"]] * g * self._longest)
        k_bases = self._bases + layer * self._layer_bytes
        for name, val in (
            ("kvh", kvh), ("g", g), ("d", d), ("q", q.data_ptr()), ("q_head", q.stride(0)),
            ("q_token", q.stride(1)), ("knew", key.data_ptr()), ("k_head", key.stride(0)),
            ("k_token", key.stride(1)), ("vnew", value.data_ptr()), ("v_head", value.stride(0)),
            ("v_token", value.stride(1)), ("kbase", k_bases),
            ("vbase", k_bases + self._num_layers * self._layer_bytes), ("window", window or 0),
            ("out", out.data_ptr()), ("scratch", scratch.data_ptr()), ("scratch_stride", g * self._longest),
        ):  # fmt: skip
            args[arg[name]] = val
        if pool is not None and slots is not None:
            if not (pool[0].is_contiguous() and pool[1].is_contiguous() and pool[0].shape[2:] == (kvh, d)):
                raise RuntimeError(f"native decode attention: a pool of {tuple(pool[0].shape)} for {kvh} x {d} K/V")
            if slots.dtype != torch.int64 or slots.shape[0] < n or not slots.is_contiguous():
                raise RuntimeError(f"native decode attention: slots {slots.dtype} {tuple(slots.shape)} for {n} decodes")
            args[arg["kpool"]], args[arg["vpool"]] = pool[0].data_ptr(), pool[1].data_ptr()
            args[arg["slot"]], args[arg["pool_slots"]] = slots.data_ptr(), pool[0].shape[0] * pool[0].shape[1]
        else:
            args[arg["kpool"]] = args[arg["vpool"]] = args[arg["slot"]] = args[arg["pool_slots"]] = 0
        # why named for the profiler: a ctypes call is invisible to profiles otherwise (only while one
        # runs: a record_function costs ~5 us even when none does)
        named = torch._C._autograd._profiler_enabled()
        with torch.profiler.record_function(PROFILE_NAME) if named else nullcontext():
            status = self.kernels.decode_attention(self._args_at, scale)
        self.calls += 1
        if status == -1:
            raise RuntimeError(f"native decode attention refused {g} query heads per KV head, head dim {d}")
        if status != 0:
            raise RuntimeError(
                "native decode attention refused a decode longer than its row, or a slot outside the pool"
            )


def kernels_for(config: PretrainedConfig, device: torch.device, dtype: torch.dtype) -> NativeKernels | None:
    """The kernel, where it can attend this model's decodes: float32 rows on the CPU, no logit
    soft-capping (Gemma 2 keeps the torch path), query heads per KV head and head dim within the
    kernel's limits. None elsewhere, or where it cannot be built (native.load logs why)."""
    if device.type != "cpu" or dtype != torch.float32 or has_softcap(config):
        return None
    text = config.get_text_config()
    spec = kv_spec(config)
    heads = text.num_attention_heads
    if heads % spec.num_kv_heads or heads // spec.num_kv_heads > native.MAX_G or spec.head_dim > native.MAX_D:
        return None
    return native.load()
