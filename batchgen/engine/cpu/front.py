"""The C++ front of the CPU backend's attention, `batchgen::attention` (csrc/attention_op.cpp).

Why: on a decode-only step with the native kernel, reaching it through the Python op cost ~0.1 ms
a layer (demo decode step of 64: 9.3 -> 8.3 ms). The backend sets a step plan in its plan cell (the
library's cell of its attention handle, which each call carries), so each layer only adds its
tensors; every other step goes on to the Python op. Without a compiler (or BATCHGEN_NATIVE=0) the op is called directly.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from batchgen.engine.cpu import native
from batchgen.engine.cpu.decode_native import PLAN_FIELDS, FrontPlan

logger = logging.getLogger(__name__)


@functools.cache
def load() -> ctypes.CDLL | None:
    """batchgen::attention built, loaded and checked, once per process (loaded code, not state: each
    plan names its kernel); None (logged) where it or the kernels cannot be."""
    kernels = native.load()
    lib = native.library("batchgen_attention_op")
    if kernels is None or lib is None:
        return None
    for name, ours in (("plan_names", PLAN_FIELDS), ("arg_names", native.DECODE_ARGS)):
        theirs = native.names_differ(lib, f"batchgen_attention_op_{name}", ours)
        if theirs:  # why: a source and this module out of step would misread memory
            native.refuse("batchgen_attention_op", f"attention_op.cpp names {theirs}, batchgen {ours}")
            return None
    lib.batchgen_attention_op_take_error.restype = ctypes.c_char_p
    lib.batchgen_attention_op_plan_cells.restype = ctypes.c_void_p
    lib.batchgen_attention_op_max_backends.restype = ctypes.c_int64
    return lib


@dataclass
class FrontStats:
    """What one front attended (for the benchmark's breakdown and the tests)."""

    steps: int = 0  # decode-only steps it attended
    layers: int = 0  # layer calls of those steps
    kernel_seconds: float = 0.0  # spent in the decode kernel by those calls


@dataclass
class Front:
    """One backend's use of the operator: its plan cell (the current plan's address, 0: none), the
    library's cell of `handle` (the backend's attention handle, which each call carries), and stats."""

    lib: ctypes.CDLL
    handle: int
    stats: FrontStats = field(default_factory=FrontStats)
    cells: ctypes.Array[ctypes.c_int64] = field(init=False)

    def __post_init__(self) -> None:
        count = self.lib.batchgen_attention_op_max_backends()
        self.cells = (ctypes.c_int64 * count).from_address(self.lib.batchgen_attention_op_plan_cells())

    @contextmanager
    def planned(self, plan: FrontPlan) -> Iterator[None]:
        """`plan` (NativeStep.front_plan) set for the operator's calls inside, counted into stats after."""
        self.cells[self.handle] = plan.fields.buffer_info()[0]
        try:
            yield
        finally:
            self.cells[self.handle] = 0
            self.stats.steps += plan.calls > 0
            self.stats.layers += plan.calls
            self.stats.kernel_seconds += plan.kernel_seconds

    def take_error(self) -> str | None:
        """The operator's last refusal since the last call (None: none): a compiled graph reports only
        that the call failed, so the caller raises this message instead."""
        raw = self.lib.batchgen_attention_op_take_error()
        return None if raw is None else raw.decode(errors="replace")


def open_front(handle: int) -> Front | None:
    """A front for the backend of attention handle `handle`, where the operator loads and has a cell
    for it (None: the model calls the Python op)."""
    lib = load()
    if lib is None:
        return None
    if not 0 <= handle < lib.batchgen_attention_op_max_backends():
        logger.warning("attention handle %d has no plan cell: this engine's decodes take the Python op", handle)
        return None
    return Front(lib, handle)
