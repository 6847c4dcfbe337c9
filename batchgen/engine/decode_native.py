"""The native decode kernel's view of one step's decode rows: addresses, lengths, shared prefixes.

Why a module: the kernel (csrc/decode_attention.c, loaded by native.py) reads each decode's row
through a raw address, so a step must hand it, per layer, where every row's keys and values
start, how long each row is (its class length, the stride between positions) and how many
positions it attends to, plus, for a group that shares a cached prefix, the row that every
member reads that prefix from. This is built once per step from the rows' classes (decode_rows)
and read by every layer; the kernel then appends the step's K/V and attends all decodes in one
call per layer, with no padding to a group's longest row and no Python per group.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        cls = torch.tensor([c for c, part in enumerate(classes) for _ in range(part.num_rows)], dtype=torch.int64)
        rows = torch.cat([torch.arange(part.num_rows, dtype=torch.int64) for part in classes])  # [n]
        self.cap = torch.tensor([part.k[0].shape[-1] for part in classes], dtype=torch.int64)[cls]  # [n]
        shared = torch.tensor([part.shared for part in classes], dtype=torch.int64)[cls]
        self.shared = shared
        # byte offsets of each row (and of the row it reads a shared prefix from) in its class tensor
        row_bytes = [torch.tensor([t.stride(0) * t.element_size() for t in (p.k[0], p.v[0])]) for p in classes]
        stride = torch.stack(row_bytes)[cls]  # [n, 2]: key row, value row
        own = rows[:, None] * stride
        pre = torch.where(shared[:, None] > 0, torch.zeros_like(own), own)
        layers = len(classes[0].k)
        base = torch.tensor(
            [[[p.k[layer].data_ptr(), p.v[layer].data_ptr()] for p in classes] for layer in range(layers)],
            dtype=torch.int64,
        )[:, cls]  # [layers, n, 2]
        self.rows = (base + own).transpose(1, 2).contiguous()  # [layers, 2, n]
        self.prefix = (base + pre).transpose(1, 2).contiguous()  # [layers, 2, n]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        out: torch.Tensor,
        scale: float,
        window: int | None,
    ) -> None:
        """Append key/value [n, KVH, D] to the rows, attend q [n, H, D] -> out [n, H, D] (all float32)."""
        n, h, d = q.shape
        kvh = key.shape[1]
        g = h // kvh
        q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
        threads = native.threads()
        stride = g * -(-self.longest // native.TILE) * native.TILE  # scratch floats per thread
        scratch = self.scratch.get(threads * stride)
        rows, prefix = self.rows[layer], self.prefix[layer]  # [2, n]: key rows, value rows
        pointers = [t.data_ptr() for t in (q, key, value, rows[0], rows[1], prefix[0], prefix[1])]
        lengths = [t.data_ptr() for t in (self.cap, self.lengths, self.shared)]
        with torch.profiler.record_function(PROFILE_NAME):  # why: a ctypes call is invisible to profiles otherwise
            status = self.kernels.decode_attention(
                n,
                kvh,
                g,
                d,
                threads,
                *pointers,
                *lengths,
                window or 0,
                scale,
                out.data_ptr(),
                scratch.data_ptr(),
                stride,
            )
        self.calls += 1
        if status != 0:
            raise RuntimeError(f"native decode attention refused {g} query heads per KV head, head dim {d}")


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
