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

    k: list[torch.Tensor]  # per layer [rows, KVH, D, cap] (keys transposed)
    v: list[torch.Tensor]  # per layer [rows, KVH, cap, D]
    num_rows: int
    shared: int  # positions every row holds in the same blocks (0: none), read from row 0


class Scratch:
    """The kernel's per-thread score rows, kept across steps and grown as needed."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.float32)

    def get(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel, dtype=torch.float32)
        return self.buffer


class NativeStep:
    """Every decode's row address per layer, and what each attends to, for one step."""

    def __init__(
        self, kernels: NativeKernels, classes: Sequence[NativeClass], lengths: torch.Tensor, scratch: Scratch
    ) -> None:
        """lengths [n]: positions each decode attends to after this step's token (packed order)."""
        self.kernels = kernels
        self.lengths = lengths
        self.longest = int(lengths.max())
        self.scratch = scratch
        self.calls = 0  # layers attended (for tests and the benchmark)
        # why arrays: torch.tensor() over Python lists costs ~0.3 us an element, an array copies at C speed
        counts = [part.num_rows for part in classes]
        self.cls = _int64([c for c, m in enumerate(counts) for _ in range(m)])  # [n] each decode's class
        self.row = _int64([r for m in counts for r in range(m)])  # [n] its row in the class
        self.cap = _int64([part.k[0].shape[-1] for part in classes for _ in range(part.num_rows)])  # [n]
        self.shared = _int64([part.shared for part in classes for _ in range(part.num_rows)])  # [n]
        # floats between rows, and per layer where each class's key and value tensors start
        self.strides = _int64([t.stride(0) for t in [p.k[0] for p in classes] + [p.v[0] for p in classes]])
        layers = range(len(classes[0].k))
        bases = [p.k[layer].data_ptr() for layer in layers for p in classes]
        bases += [p.v[layer].data_ptr() for layer in layers for p in classes]
        self.bases = _int64(bases).view(2, len(layers), len(classes))  # [key | value, layers, classes]

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
        q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
        threads = native.threads()
        stride = g * -(-self.longest // native.TILE) * native.TILE  # scratch floats per thread
        scratch = self.scratch.get(threads * stride)
        classes = self.strides.shape[0] // 2
        tables = (self.bases[0, layer], self.bases[1, layer], self.strides[:classes], self.strides[classes:])
        pointers = [t.data_ptr() for t in (q, key, value, *tables)]
        lengths = [t.data_ptr() for t in (self.cls, self.row, self.cap, self.lengths, self.shared)]
        stores = [0, 0, 0] if pool is None or slots is None else [t.data_ptr() for t in (*pool, slots)]
        # why named for the profiler: a ctypes call is invisible to profiles otherwise (only while one
        # runs: a record_function costs ~5 us even when none does)
        named = torch._C._autograd._profiler_enabled()
        with torch.profiler.record_function(PROFILE_NAME) if named else nullcontext():
            status = self.kernels.decode_attention(
                n, kvh, g, d, threads, *pointers, *lengths, *stores, window or 0, scale, out.data_ptr(),
                scratch.data_ptr(), stride,
            )  # fmt: skip
        self.calls += 1
        if status != 0:
            raise RuntimeError(f"native decode attention refused {g} query heads per KV head, head dim {d}")


def _int64(values: list[int]) -> torch.Tensor:
    return torch.frombuffer(array("q", values), dtype=torch.int64)


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
