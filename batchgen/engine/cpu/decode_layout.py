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
from batchgen.engine.cpu.decode_native import NativeClass, NativeStep, Scratch
from batchgen.engine.cpu.native import NativeKernels

logger = logging.getLogger(__name__)

ROWS, LENGTH, CAPACITY = 16, 256, 512  # a mid-sized decode step: sequences, positions, row length
REPEATS = 7


def keys_transposed(dtype: torch.dtype, kv_heads: int, group: int, head_dim: int) -> bool:
    """Whether decode rows of this shape store keys transposed (batched products) rather than as rows (SDPA)."""
    if dtype == torch.float32:
        return True
    path = choice_path("decode-layout", f"{dtype}\0{kv_heads}\0{group}\0{head_dim}")
    stored = read_choice(path, "transposed")
    if stored is not None:
        return bool(stored)
    batched, sdpa = _time_both(dtype, kv_heads, group, head_dim)
    if batched >= sdpa:  # a second round first: a busy spell can stall oneDNN's threads for a whole round
        again = _time_both(dtype, kv_heads, group, head_dim)
        batched, sdpa = min(batched, again[0]), min(sdpa, again[1])
    choice = batched < sdpa
    logger.info(
        "decode attention in %s (KVH %d, G %d, D %d): batched products %.2f ms, SDPA %.2f ms: %s",
        dtype, kv_heads, group, head_dim, batched * 1e3, sdpa * 1e3, "batched" if choice else "SDPA",
    )  # fmt: skip
    return bool(write_once(path, "transposed", {"transposed": choice, "batched_s": batched, "sdpa_s": sdpa}))


def native_wins(dtype: torch.dtype, kv_heads: int, group: int, head_dim: int, kernels: NativeKernels) -> bool:
    """Whether the native kernel attends this shape's decodes faster than torch's better path
    (float32: always taken, untimed; other dtypes than bf16: never, the kernel cannot read them)."""
    if dtype == torch.float32:
        return True
    if dtype not in native.KERNEL_DTYPES:
        return False
    path = choice_path("decode-native", f"{kernels.path.name}\0{dtype}\0{kv_heads}\0{group}\0{head_dim}")
    stored = read_choice(path, "native")
    if stored is not None:
        return bool(stored)
    ours, batched, sdpa = _time_all(dtype, kv_heads, group, head_dim, kernels)
    if ours >= min(batched, sdpa):  # a second round first, as keys_transposed does
        again = _time_all(dtype, kv_heads, group, head_dim, kernels)
        ours, batched, sdpa = min(ours, again[0]), min(batched, again[1]), min(sdpa, again[2])
    choice = ours < min(batched, sdpa)
    logger.info(
        "decode attention in %s (KVH %d, G %d, D %d): native kernel %.2f ms, batched products %.2f ms, "
        "SDPA %.2f ms: %s",
        dtype, kv_heads, group, head_dim, ours * 1e3, batched * 1e3, sdpa * 1e3, "native" if choice else "torch",
    )  # fmt: skip
    record = {"native": choice, "native_s": ours, "batched_s": batched, "sdpa_s": sdpa}
    return bool(write_once(path, "native", record))


def _time_both(dtype: torch.dtype, kvh: int, g: int, d: int) -> tuple[float, float]:
    """Best seconds of each torch path over REPEATS interleaved runs (one warm-up each), same inputs."""
    batched, sdpa, _ = _time_paths(dtype, kvh, g, d, None)
    return batched, sdpa


def _time_all(dtype: torch.dtype, kvh: int, g: int, d: int, kernels: NativeKernels) -> tuple[float, float, float]:
    """Best seconds of the native kernel, the batched products and SDPA, interleaved, same inputs."""
    batched, sdpa, ours = _time_paths(dtype, kvh, g, d, kernels)
    return ours, batched, sdpa


def _time_paths(
    dtype: torch.dtype, kvh: int, g: int, d: int, kernels: NativeKernels | None
) -> tuple[float, float, float]:
    """Best seconds of the batched products, SDPA and (with `kernels`) the native kernel (else inf)."""
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

    paths = [batched, sdpa] + ([_native_call(kernels, dtype, kvh, g, d, gen)] if kernels is not None else [])
    best = [float("inf")] * 3
    with torch.inference_mode():
        for i in range(REPEATS + 1):
            for side, fn in enumerate(paths):
                started = time.perf_counter()
                fn()
                if i:
                    best[side] = min(best[side], time.perf_counter() - started)
    return best[0], best[1], best[2]


def _native_call(
    kernels: NativeKernels, dtype: torch.dtype, kvh: int, g: int, d: int, gen: torch.Generator
) -> Callable[[], None]:
    """One layer's native decode attention of the same shape: ROWS decodes of LENGTH positions in
    rows of CAPACITY (each call appends its step's K/V at the last position, as a decode does)."""
    tiles = CAPACITY // native.TILE
    k = torch.randn(ROWS, kvh, tiles, d, native.TILE, generator=gen).to(dtype)  # [B, KVH, cap / TILE, D, TILE]
    v = torch.randn(ROWS, kvh, CAPACITY, d, generator=gen).to(dtype)  # [B, KVH, cap, D]
    step = NativeStep(kernels, [NativeClass([k], [v], ROWS, 0)], [LENGTH] * ROWS, Scratch())
    q = torch.randn(kvh * g, ROWS, d, generator=gen).to(dtype)  # [H, T, D]
    new_k = torch.randn(kvh, ROWS, d, generator=gen).to(dtype)  # [KVH, T, D]
    new_v = torch.randn(kvh, ROWS, d, generator=gen).to(dtype)
    out = torch.empty(ROWS, kvh * g, d, dtype=dtype)  # [T, H, D]
    return lambda: step.attend(0, q, new_k, new_v, out, d**-0.5, None)
