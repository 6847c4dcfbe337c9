"""How a reduced-precision (bf16, fp16) model's decodes are attended on this machine: measured.

Why measured: a bf16 model's decode attention is the native kernel's bf16 twin (bf16 rows widened
to float32 as they are loaded, float32 sums: csrc/decode_attention_bf16.c) or one of two torch
paths, chosen by how the keys are stored (attention/torch_math._attend_decodes):
- keys transposed [D, L]: two batched products (scores, then values) in float32 (a bf16 product
  rounds the scores to 3 digits before the softmax, and failed the reduced-precision policy);
- keys as rows [L, D]: SDPA (oneDNN's flash attention for the CPU).
On an Intel Xeon with AMX SDPA won in bf16 (4.4-5.0 ms against 5.8-6.0 ms for 4 layers of 64 x 266);
on an AMD Zen 4 (AVX512-BF16, no AMX) SDPA's bf16 decodes took 10-20x as long as bf16 batched
products (16 x 16 heads x 256 positions, one query per KV head: 13-20 ms against 2-3 ms), and the
engine's h1024 sweep shape ran 1.20x faster end to end with the float32 batched products.
No ISA rule predicts that, so for each model shape the paths are timed side by side, interleaved,
once per machine, torch version and thread count: the native kernel against the better torch path
(native_wins), and where it loses or is missing, the two torch layouts (keys_transposed). Each result
is cached and never replaced, so every process on a machine takes the same path (their tokens
agree). float32 keeps the native kernel, else its transposed keys (measured faster in earlier
passes: benchmarks/RESULTS.md), and is not timed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from batchgen.engine.attention.torch_math import _batched_decode_attention
from batchgen.engine.cpu import native
from batchgen.engine.cpu.choice_cache import choice_path, read_choice, write_once
from batchgen.engine.cpu.decode_native import ClassRows, NativeStep, Scratch
from batchgen.engine.cpu.native import NativeKernels

logger = logging.getLogger(__name__)

ROWS, LENGTH, CAPACITY = 16, 256, 512  # a mid-sized decode step: sequences, positions, row length
REPEATS = 7


def keys_transposed(dtype: torch.dtype, kv_heads: int, group: int, head_dim: int) -> bool:
    """Whether decode rows of this shape store keys transposed (batched products) rather than as rows (SDPA)."""
    return dtype == torch.float32 or _first_wins("decode-layout", "transposed", dtype, kv_heads, group, head_dim)


def native_wins(dtype: torch.dtype, kv_heads: int, group: int, head_dim: int, kernels: NativeKernels) -> bool:
    """Whether the native kernel attends this shape's decodes faster than torch's better path
    (float32: always taken, untimed; other dtypes than bf16: never, the kernel cannot read them)."""
    if dtype == torch.float32 or dtype not in native.KERNEL_DTYPES:
        return dtype == torch.float32
    return _first_wins("decode-native", "native", dtype, kv_heads, group, head_dim, kernels)


def _first_wins(
    folder: str, field: str, dtype: torch.dtype, kvh: int, g: int, d: int, kernels: NativeKernels | None = None
) -> bool:
    """Whether the first path of _time_paths (the native kernel with `kernels`, else the batched
    products) is faster than the others: the cached answer, else measured and cached."""
    key = f"{dtype}\0{kvh}\0{g}\0{d}"
    path = choice_path(folder, key if kernels is None else f"{kernels.path.name}\0{key}")
    stored = read_choice(path, field)
    if stored is not None:
        return bool(stored)
    times = _time_paths(dtype, kvh, g, d, kernels)
    first, *others = times
    if times[first] >= min(times[o] for o in others):  # a second round first: a busy spell can stall
        again = _time_paths(dtype, kvh, g, d, kernels)  # oneDNN's threads for a whole round
        times = {name: min(s, again[name]) for name, s in times.items()}
    choice = times[first] < min(times[o] for o in others)
    logger.info(
        "decode attention in %s (KVH %d, G %d, D %d): %s: %s",
        dtype, kvh, g, d, ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in times.items()),
        first if choice else "the others",
    )  # fmt: skip
    record = {field: choice, **{f"{name}_s": s for name, s in times.items()}}
    return bool(write_once(path, field, record))


def _time_paths(dtype: torch.dtype, kvh: int, g: int, d: int, kernels: NativeKernels | None) -> dict[str, float]:
    """Best seconds of each path over REPEATS interleaved runs (one warm-up each), same inputs:
    {"native": (with `kernels`), "batched": batched products, "sdpa": SDPA}."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(ROWS, kvh, g, d, generator=gen).to(dtype)  # [B, KVH, G, D]
    # as the rows hold them: LENGTH positions of rows CAPACITY long
    k = torch.randn(ROWS, kvh, CAPACITY, d, generator=gen).to(dtype)[:, :, :LENGTH]  # [B, KVH, L, D]
    v = torch.randn(ROWS, kvh, CAPACITY, d, generator=gen).to(dtype)[:, :, :LENGTH]
    k_t = k.transpose(-1, -2).contiguous()  # [B, KVH, D, L]
    bias = torch.zeros(ROWS * kvh, 1, LENGTH, dtype=dtype).expand(-1, g, -1)  # [B * KVH, G, L]
    mask = torch.ones(ROWS, 1, g, LENGTH, dtype=torch.bool)
    out = torch.empty(ROWS * kvh, g, d, dtype=dtype)
    scale = d**-0.5

    def batched() -> None:
        _batched_decode_attention(q.reshape(-1, g, d), k_t, v, bias, scale, out)

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    paths = {"batched": batched, "sdpa": sdpa}
    if kernels is not None:
        paths = {"native": _native_call(kernels, dtype, kvh, g, d, gen), **paths}
    best = dict.fromkeys(paths, float("inf"))
    with torch.inference_mode():
        for i in range(REPEATS + 1):
            for name, fn in paths.items():
                started = time.perf_counter()
                fn()
                if i:
                    best[name] = min(best[name], time.perf_counter() - started)
    return best


def _native_call(
    kernels: NativeKernels, dtype: torch.dtype, kvh: int, g: int, d: int, gen: torch.Generator
) -> Callable[[], None]:
    """One layer's native decode attention of the same shape: ROWS decodes of LENGTH positions in
    rows of CAPACITY (each call appends its step's K/V at the last position, as a decode does)."""
    tiles = CAPACITY // native.TILE
    k = torch.randn(ROWS, kvh, tiles, d, native.TILE, generator=gen).to(dtype)  # [B, KVH, cap / TILE, D, TILE]
    v = torch.randn(ROWS, kvh, CAPACITY, d, generator=gen).to(dtype)  # [B, KVH, cap, D]
    step = NativeStep(kernels, [ClassRows([k], [v], ROWS, 0)], [LENGTH] * ROWS, Scratch())
    q = torch.randn(kvh * g, ROWS, d, generator=gen).to(dtype)  # [H, T, D]
    new_k = torch.randn(kvh, ROWS, d, generator=gen).to(dtype)  # [KVH, T, D]
    new_v = torch.randn(kvh, ROWS, d, generator=gen).to(dtype)
    out = torch.empty(ROWS, kvh * g, d, dtype=dtype)  # [T, H, D]
    return lambda: step.attend(0, q, new_k, new_v, out, d**-0.5, None)
