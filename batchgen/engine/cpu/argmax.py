"""Greedy ids through the native argmax kernel (csrc/row_argmax.c), where it can read the logits.

Why: one pass over the rows gives each row's first index of its maximum and whether any entry is
NaN, where torch's max over the last dimension took ~160 us for 64 x 4,096 logits just after the
forward, and the NaN flag a second pass over its maxima. The sampler is handed this function on
the CPU (its Platform's greedy_ids, cpu/platform) and keeps torch's path for everything else.
"""

from __future__ import annotations

import torch

from batchgen.engine.cpu import native


def native_greedy_ids(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logits [n, V] -> (ids [n] int64, a 0-d bool: some entry is NaN), as torch.max(dim=-1) gives
    them (a NaN row gives its first NaN); None where the kernel cannot read them (not float32 rows
    on the CPU with unit stride, or the kernel did not build)."""
    n, vocab = logits.shape
    if not (logits.is_cpu and logits.dtype == torch.float32 and vocab and logits.stride(1) == 1):
        return None
    kernel = native.argmax()
    if kernel is None:
        return None
    ids = torch.empty(n, dtype=torch.int64)
    nan_rows = kernel(n, vocab, logits.data_ptr(), logits.stride(0), ids.data_ptr(), native.threads())
    return ids, torch.tensor(nan_rows > 0)
