"""glibc heap settings for CPU inference: freed activation memory stays in the process.

Why: by default glibc serves multi-MB activations from fresh mmap()s and trims on free, so every
prefill step faulted its pages in again (a fresh 16 MB write took 3-18 ms instead of ~1;
RESULTS.md, issue 11). The cost: up to TRIM_THRESHOLD of freed heap kept, process-wide, glibc only.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

# mallopt parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit: blocks up to 32 MiB come from the heap
TRIM_THRESHOLD = 1 << 30  # return the heap top to the OS only past 1 GiB of free space
TOP_PAD = 64 << 20  # grow the heap in 64 MiB steps, not one block at a time

DISABLE_ENV = "BATCHGEN_MALLOC_DEFAULTS"  # set to 1: leave glibc's own settings alone


@functools.cache
def keep_freed_memory() -> bool:
    """Apply the settings above once per process; True if glibc took all three."""
    if os.environ.get(DISABLE_ENV) == "1":
        logger.info("heap settings left alone (%s=1)", DISABLE_ENV)
        return False
    libc = _glibc()
    if libc is None:
        return False
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    ok = all(libc.mallopt(param, value) == 1 for param, value in settings)
    logger.info(
        "glibc heap: blocks up to %d MiB from the heap, trimmed past %d MiB (%s)",
        MMAP_THRESHOLD >> 20,
        TRIM_THRESHOLD >> 20,
        "applied" if ok else "refused",
    )
    return ok


def _glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc (only glibc has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded into the process, libc's among them
        libc.gnu_get_libc_version  # noqa: B018 - a lookup, raises AttributeError elsewhere
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc
