"""The CPU heap settings (cpu_heap): a step's large activations come from the heap and stay there.

Each case runs in a fresh interpreter, because the settings are process-wide and applied once.
glibc's own counters (mallinfo2) say where a 16 MiB tensor came from: its mmapped bytes
(`hblkhd`) or its heap (`arena`), and whether the heap kept the block once it was freed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from batchgen import LLM
from batchgen.engine.cpu import heap as cpu_heap

SCRIPT = """
import ctypes, torch
from batchgen.engine.cpu import heap as cpu_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = cpu_heap.keep_freed_memory()
before = libc.mallinfo2()
x = torch.ones(4 << 20)  # 16 MiB, as one MLP activation of a 2,048-token step of the 57M model
held = libc.mallinfo2()
del x
after = libc.mallinfo2()
print(applied, held.hblkhd - before.hblkhd, held.arena - before.arena, after.arena - before.arena)
"""
MIB = 1 << 20


def _run(**env: str) -> tuple[str, int, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1]), int(out[2]), int(out[3])


@pytest.mark.skipif(cpu_heap._glibc() is None, reason="the settings are glibc's; this C library is not glibc")
def test_large_activations_come_from_the_heap_and_stay_there() -> None:
    applied, mmapped, heap_grew, heap_kept = _run()
    assert applied == "True"
    assert mmapped == 0  # not a fresh mmap (whose pages would all fault in again next step)
    assert heap_grew >= 16 * MIB
    assert heap_kept >= 16 * MIB  # freed, the block is kept for the next step, not trimmed away
    # the control: glibc's own settings map a fresh block of that size and unmap it when freed
    applied, mmapped, heap_grew, _ = _run(**{cpu_heap.DISABLE_ENV: "1"})
    assert applied == "False"
    assert mmapped >= 16 * MIB and heap_grew < 16 * MIB


def test_an_engine_on_cpu_applies_them(tiny_model: Callable[[str], Path]) -> None:
    LLM(str(tiny_model("llama")), device="cpu", dtype="float32")
    assert cpu_heap.keep_freed_memory.cache_info().currsize == 1  # applied, once
    assert cpu_heap.keep_freed_memory() == (cpu_heap._glibc() is not None)
