"""The C++ front of the attention, `batchgen::attention` (csrc/attention_op.cpp), on the CPU.

Why: in a decode-only step with the native kernel, each layer's attention is one kernel call, but
reaching it through the Python custom op (attention_op) cost ~0.1 ms a layer or more: the op's
dispatch, the step context, the checks and the kernel's per-layer arguments. Here the model's
attention calls a C++ operator instead (the demo model's decode step of 64 sequences: 9.3 -> 8.3
ms run alone; 11.1 -> 10.4 ms alternating with transformers' forward, which evicts the caches). For such a step the
model runner sets a plan around the forward (`decode_plan`): what holds for the whole step, which
the decode source's NativeStep builds once, so each layer's call only adds its own tensors and
calls the kernel. Every other step (prefills, the torch decode path, no plan) goes on to the
Python op with the same arguments, so eager and compiled runs still share one attention code.

Where the operator cannot be built (no C++ compiler, BATCHGEN_NATIVE=0) or off the CPU, the model
calls the Python op directly, as before.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from batchgen.engine.attention import op as attention_op
from batchgen.engine.attention.metadata import ForwardContext
from batchgen.engine.cpu import native, native_ops
from batchgen.engine.cpu.decode_native import PLAN_FIELDS, FrontPlan
from batchgen.engine.cpu.rows_view import RowsView

OP_SOURCE = native_ops.OPERATORS["batchgen_attention_op"]

_LIB: list[ctypes.CDLL | None] = []  # once per process: the operator's library, None where it cannot be


def load() -> bool:
    """batchgen::attention built, loaded and given the kernel, once per process; False (logged) where it cannot be."""
    if not _LIB:
        _LIB.append(_load())
        attention_op.FRONT_READY[0] = _LIB[0] is not None
    return _LIB[0] is not None


def _load() -> ctypes.CDLL | None:
    kernels = native.load()
    lib = native_ops.load_op("batchgen_attention_op", OP_SOURCE, "attention goes through the Python op", "attention")
    if kernels is None or lib is None:
        return None
    for name, ours in (("plan_names", PLAN_FIELDS), ("arg_names", native.DECODE_ARGS)):
        fn = getattr(lib, f"batchgen_attention_op_{name}")
        fn.restype = ctypes.c_char_p
        theirs = tuple(fn().decode().lower().split())
        if theirs != ours:  # why: a source and this module out of step would misread memory
            native_ops.refuse("batchgen_attention_op", f"{OP_SOURCE.name} names {theirs}, batchgen {ours}")
            return None
    lib.batchgen_attention_op_setup.argtypes = [ctypes.c_void_p]
    lib.batchgen_attention_op_setup(ctypes.cast(kernels.decode_attention, ctypes.c_void_p))
    lib.batchgen_attention_plan.argtypes = [ctypes.c_void_p]
    lib.batchgen_attention_op_take_error.restype = ctypes.c_char_p
    attention_op.FRONT_ERRORS[:] = [lambda: _message(lib.batchgen_attention_op_take_error())]
    return lib


def _message(raw: bytes | None) -> str | None:
    return None if raw is None else raw.decode(errors="replace")


@dataclass
class FrontStats:
    """What the front attended in this process (for the benchmark's breakdown and the tests)."""

    steps: int = 0  # decode-only steps it attended
    layers: int = 0  # layer calls of those steps
    kernel_seconds: float = 0.0  # spent in the decode kernel by those calls


STATS = FrontStats()


@contextmanager
def decode_plan(ctx: ForwardContext, num_heads: int) -> Iterator[None]:
    """Around one forward: when the step is decodes only, on the native kernel, the operator
    attends every layer itself (new rows filled from the pool first, for every layer); otherwise
    nothing changes. Counts the layers it attended into ctx.num_attention_calls."""
    step = ctx.decodes
    plain = not ctx.prefills and ctx.flash is None and ctx.static_decode is None
    if not _LIB or _LIB[0] is None or not plain or not isinstance(step, RowsView) or step.native is None:
        yield
        return
    step.fill_all(ctx.kv_caches)
    plan = step.native.front_plan(ctx.kv_caches, ctx.slot_mapping, num_heads, ctx.num_tokens)
    with planned(plan):
        yield
    ctx.num_attention_calls += plan.calls
    step.native.calls += plan.calls


@contextmanager
def planned(plan: FrontPlan) -> Iterator[None]:
    """`plan` (NativeStep.front_plan) set for the operator's calls inside, counted into STATS after."""
    if not load():
        raise RuntimeError(f"{attention_op.FRONT_OP_NAME} is not available here (see the log)")
    lib = _LIB[0]
    assert lib is not None
    lib.batchgen_attention_plan(plan.fields.buffer_info()[0])
    try:
        yield
    finally:
        lib.batchgen_attention_plan(None)
        STATS.steps += plan.calls > 0
        STATS.layers += plan.calls
        STATS.kernel_seconds += plan.kernel_seconds
