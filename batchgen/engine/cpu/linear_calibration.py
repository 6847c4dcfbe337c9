"""Which row counts of which linear shapes (and dtypes) the native linear kernel takes on this machine: measured.

Why measured: the kernels (csrc/skinny_linear.c, wide_linear.c) beat MKL's sgemm by 1.2-1.8x on
one AMD host with AVX-512 and lost to it by 5-12x on an AVX2-only one; on an Intel host they tie
it at a row or two and win at decode sizes only in models too large for the cache. No vendor, ISA
or size rule predicts that, and a busy machine shifts it again. So for each weight shape of a model
the kernel and torch's own linear are timed side by side, interleaved, over all of the model's
weights of that shape (a decode step's pass, so weights leave the cache as they do in a run), at
each row bucket (rows in (2^(b-1), 2^b], both ends timed); the kernel takes a bucket only where its
best time beat torch's best by MARGIN at both ends. Buckets past one whose torch pass took longer
than SLOW_CALL, or past STOP_AFTER_LOSSES lost in a row, are not timed, and neither is anything
once a model's calibration has spent BUDGET_SECONDS: an untimed bucket stays on torch, so a large
model costs a few seconds once.

A bf16 model's linears are measured the same way, the kernel's bf16 twin (skinny_linear_bf16.c)
against torch's bf16 linear (oneDNN's AVX512-BF16 or AMX path), under keys of their own (shape_key).
The result is cached per machine (the kernel library's name holds its sources, flags, compiler and
CPU), torch version and thread count, one file per shape and dtype, written once and never replaced: every
process on a machine then takes the same choice (the first one measured), so a job's tokens do not
depend on which process timed what.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch.nn import functional as F

from batchgen.engine.cpu.choice_cache import choice_path, interleaved_best, read_choice, write_once

BUCKETS = tuple(range(12))  # rows up to 2^11 = 2,048: decode steps and prefill chunks of the CPU default
MARGIN = 0.9  # the kernel's best time must be below this share of torch's best
REPEATS = 5  # interleaved timings of each side per row count; the best of each is compared
SLOW_CALL = 0.05  # seconds: a torch pass slower than this is not timed at larger buckets
STOP_AFTER_LOSSES = 3  # buckets lost in a row after which larger ones are not timed
BUDGET_SECONDS = 8.0  # per model: what is left untimed stays on torch

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def bucket(rows: int) -> int:
    """0 for one row, b for rows in (2^(b-1), 2^b] (as linear_op.cpp computes it)."""
    return 0 if rows <= 1 else (rows - 1).bit_length()


def bucket_ends(b: int) -> tuple[int, ...]:
    """The row counts a bucket is timed at: both ends."""
    return (1,) if b == 0 else tuple(sorted({2 ** (b - 1) + 1, 2**b}))


def shape_key(weight: torch.Tensor, bias: torch.Tensor | None) -> str:
    """The weight's shape, bias and (but for float32, whose keys predate the others) dtype: each is
    measured and cached on its own (a bf16 model's linears race torch's bf16 path, not its float32 one)."""
    dtype = "" if weight.dtype == torch.float32 else f":{str(weight.dtype).removeprefix('torch.')}"
    return f"{weight.shape[0]}x{weight.shape[1]}{'+bias' if bias is not None else ''}{dtype}"


def masks(
    groups: Mapping[str, Sequence[tuple[torch.Tensor, torch.Tensor | None]]], kernel: Linear, library: Path
) -> dict[str, int]:
    """Per shape key, the bucket mask for the kernel (0: torch everywhere): from the cache, else measured
    and cached. `groups`: per shape key, every (weight, bias) of the model with that shape."""
    deadline = time.monotonic() + BUDGET_SECONDS
    out = {}
    for key, layers in groups.items():
        path = choice_path("linear-calibration", f"{library.name}\0{key}")
        cached = read_choice(path, "mask")
        if cached is None:
            cached = write_once(path, "mask", {"mask": measure(layers, kernel, deadline)})
        out[key] = int(cached)
    return out


def measure(layers: Sequence[tuple[torch.Tensor, torch.Tensor | None]], kernel: Linear, deadline: float) -> int:
    """The bucket mask where `kernel` beat torch's linear over every layer of one shape."""
    mask, losses = 0, 0
    k = layers[0][0].shape[1]
    for b in BUCKETS:
        wins, slow = True, False
        for rows in bucket_ends(b):
            x = torch.randn(rows, k).to(layers[0][0].dtype)  # as the model computes: its weights' dtype
            passes = {s: functools.partial(_pass, layers, x, fn) for s, fn in (("ours", kernel), ("torch", F.linear))}
            best = interleaved_best(passes, REPEATS, deadline)  # each a pass over every layer, interleaved
            if best is None:  # out of time: this bucket and larger ones stay on torch
                return mask
            wins = wins and best["ours"] < MARGIN * best["torch"]
            slow = slow or best["torch"] > SLOW_CALL
        mask |= wins << b
        losses = 0 if wins else losses + 1
        if slow or losses == STOP_AFTER_LOSSES:
            break  # why stop: the BLAS pulls further ahead with rows, and an untimed bucket stays on torch
    return mask


def _pass(layers: Sequence[tuple[torch.Tensor, torch.Tensor | None]], x: torch.Tensor, fn: Linear) -> None:
    for weight, bias in layers:
        fn(x, weight, bias)
