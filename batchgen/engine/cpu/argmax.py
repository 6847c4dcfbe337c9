"""Greedy ids through the native argmax kernel (csrc/row_argmax.c), where it can read the logits.

Why: one pass over the rows gives each row's first index of its maximum and whether any entry is
NaN, where torch's max over the last dimension took ~160 us for 64 x 4,096 logits just after the
forward, and the NaN flag a second pass over its maxima. The sampler is handed this function on
the CPU (its Platform's greedy_ids, cpu/platform) and keeps torch's path for everything else.

bf16 logits (a bf16 model's, read without a float32 copy) go to the kernel's bf16 twin
(csrc/row_argmax_bf16.c) where it measures faster than torch's max over the same bf16 logits, per
vocabulary size, once per machine (cached like the other measured choices); both give the ids and
NaN flag of the float32 conversion of the logits, so the choice moves time, never tokens.
"""

from __future__ import annotations

import logging

import torch

from batchgen.engine.cpu import native
from batchgen.engine.cpu.choice_cache import choice_path, interleaved_best, read_choice, write_once
from batchgen.engine.cpu.native import CFunction

logger = logging.getLogger(__name__)

ROWS, REPEATS = 32, 9  # a mid-sized decode step's logit rows; rounds of the interleaved timing
_CHOSEN: dict[int, bool] = {}  # vocabulary size -> the bf16 kernel wins (once per process)


def native_greedy_ids(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [n, V] -> (ids [n] int64, a 0-d bool: some entry is NaN), as torch.max(dim=-1) gives
    them (a NaN row gives its first NaN); None where the kernel does not take them (not float32 or
    bf16 rows on the CPU with unit stride, the kernel did not build, or torch measured faster)."""
    n, vocab = logits.shape
    if not (logits.is_cpu and vocab and logits.stride(1) == 1):
        return None
    kernel = _kernel(logits.dtype, vocab)
    if kernel is None:
        return None
    ids = torch.empty(n, dtype=torch.int64)
    nan_rows = kernel(n, vocab, logits.data_ptr(), logits.stride(0), ids.data_ptr(), native.threads())
    return ids, torch.tensor(nan_rows > 0)


def _kernel(dtype: torch.dtype, vocab: int) -> CFunction | None:
    if dtype not in native.KERNEL_DTYPES:
        return None
    kernel = native.function("batchgen_row_argmax", dtype)
    if kernel is None or dtype == torch.float32:
        return kernel
    if vocab not in _CHOSEN:
        _CHOSEN[vocab] = bf16_kernel_wins(kernel, vocab)
    return kernel if _CHOSEN[vocab] else None


def bf16_kernel_wins(kernel: CFunction, vocab: int) -> bool:
    """Whether the bf16 kernel beats torch's max (and its NaN flag) on ROWS x `vocab` bf16 logits:
    timed interleaved, best of REPEATS each, once per machine, torch version and thread count."""
    path = choice_path("argmax-bf16", str(vocab))
    stored = read_choice(path, "native")
    if stored is not None:
        return bool(stored)
    logits = torch.randn(ROWS, vocab, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [ROWS, V]
    ids = torch.empty(ROWS, dtype=torch.int64)
    calls = {
        "native": lambda: kernel(ROWS, vocab, logits.data_ptr(), vocab, ids.data_ptr(), native.threads()),
        "torch": lambda: bool(logits.max(dim=-1).values.amax().isnan()),  # the ids and the NaN flag
    }
    best = interleaved_best(calls, REPEATS)
    assert best is not None  # no deadline
    ours, torchs = best["native"], best["torch"]
    wins = ours < torchs
    logger.info(
        "greedy argmax of %d x %d bf16 logits: native %.1f us, torch %.1f us: %s",
        ROWS, vocab, ours * 1e6, torchs * 1e6, "native" if wins else "torch",
    )  # fmt: skip
    return bool(write_once(path, "native", {"native": wins, "native_s": ours, "torch_s": torchs}))
