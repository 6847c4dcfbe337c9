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
        self.longest = max(lengths)
        self.scratch = scratch
        self.calls = 0  # layers attended (for tests and the benchmark)
        n, num_classes, num_layers = len(lengths), len(classes), len(classes[0].k)
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
        start, size = self.table.data_ptr(), self.table.element_size()
        self._per_decode = [start + i * n * size for i in range(5)]  # class, row, cap, length, shared (the C order)
        strides = start + 5 * n * size
        self._strides = (strides, strides + num_classes * size)  # key rows, value rows
        self._bases = strides + 2 * num_classes * size  # [key | value, layers, classes]
        self._layer_bytes, self._num_layers = num_classes * size, num_layers

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
        """Append key/value [n, KVH, D] to the rows, attend q [n, H, D] -> out [n, H, D] (all float32);
        with `pool` (K, V [blocks, block_size, KVH, D], contiguous) and `slots` [n], store them there too."""
        n, h, d = q.shape
        kvh = key.shape[1]
        g = h // kvh
        # why checked here: the kernel reads and writes through raw addresses, so a wrong shape or
        # dtype would corrupt memory instead of raising
        if key.shape != (n, kvh, d) or value.shape != key.shape or out.shape != q.shape or n != self.lengths.shape[0]:
            raise RuntimeError(
                f"native decode attention: q {tuple(q.shape)}, key {tuple(key.shape)}, "
                f"value {tuple(value.shape)}, out {tuple(out.shape)} for {self.lengths.shape[0]} decodes"
            )
        if {t.dtype for t in (q, key, value, out)} != {torch.float32} or not out.is_contiguous():
            raise RuntimeError("native decode attention needs float32 tensors and a contiguous output")
        q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
        threads = native.threads()
        stride = g * -(-self.longest // native.TILE) * native.TILE  # scratch floats per thread
        scratch = self.scratch.get(threads * stride)
        k_bases = self._bases + layer * self._layer_bytes
        v_bases = k_bases + self._num_layers * self._layer_bytes
        stores = [0, 0, 0, 0]
        if pool is not None and slots is not None:
            if not (pool[0].is_contiguous() and pool[1].is_contiguous() and pool[0].shape[2:] == (kvh, d)):
                raise RuntimeError(f"native decode attention: a pool of {tuple(pool[0].shape)} for {kvh} x {d} K/V")
            stores = [pool[0].data_ptr(), pool[1].data_ptr(), slots.data_ptr(), pool[0].shape[0] * pool[0].shape[1]]
        # why named for the profiler: a ctypes call is invisible to profiles otherwise (only while one
        # runs: a record_function costs ~5 us even when none does)
        named = torch._C._autograd._profiler_enabled()
        with torch.profiler.record_function(PROFILE_NAME) if named else nullcontext():
            status = self.kernels.decode_attention(
                n, kvh, g, d, threads, q.data_ptr(), key.data_ptr(), value.data_ptr(), k_bases, v_bases,
                *self._strides, *self._per_decode, *stores, window or 0, scale, out.data_ptr(), scratch.data_ptr(),
                stride,
            )  # fmt: skip
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
