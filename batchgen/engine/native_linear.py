"""A model's large linear layers at decode sizes through the native kernels (csrc/skinny_linear.c, wide_linear.c).

Why: a decode step multiplies a few rows (one per decoding sequence) by every weight matrix, so
its linears are bound by reading the weights once. float32 sgemm on nn.Linear's [out, in] weights
is far from that at 4-32 rows; the kernel reads each weight row once, in place (no packed copy),
against all rows, overlapping the reads with the arithmetic (the 57M model's 56 linears at 8 rows:
16.1 -> 9 ms; at 64 rows 30-32 -> 29 ms; benchmarks/RESULTS.md, issue 11's seventh pass). From 24
rows the multiply-adds bound a call instead, and a second kernel takes it: x transposed once, each
weight broadcast into vectors of 16 rows, no sums across lanes (64 rows on an EPYC host: 57-62 ms
-> 38-40 ms, sgemm 51-75 ms; the twelfth pass).
Prefill-sized calls stay on the BLAS, built for them, as do models whose weights are small enough
to stay in cache between steps (the demo model's), where sgemm keeps up.

How: each eligible nn.Linear's class becomes NativeLinear (same parameters, same module tree),
whose forward calls the operator `batchgen::linear` (csrc/linear_op.cpp, built against this torch
on first use): one opaque node to torch.compile, which takes the kernel at up to MAX_ROWS rows
and at::linear above, so one compiled graph serves every step size. Why a C++ operator: from a
compiled graph a call costs 12.9 us through a Python custom op, 2.8 us through this one (aten's
own linear: 1.2 us); the Python op's share was 0.65 ms of a 57M decode step. Where the operator
cannot be built (no C++ compiler, BATCHGEN_NATIVE=0) the linears stay as they are.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch import nn

from batchgen.engine import native, native_ops

logger = logging.getLogger(__name__)

OP_NAME = "batchgen::linear"  # its CPU implementation: OP_SOURCE
OP_SOURCE = Path(__file__).parent / "csrc" / "linear_op.cpp"
# rows up to which the kernel is used: on the 57M model's linears it tied sgemm at 1-2 rows and beat it
# at 4-64, the most measured (max_num_seqs on the CPU)
MAX_ROWS = 64
# 64 MiB of float32 linear weights in the model. Below it (the demo model's 16 MiB) the weights stay
# in cache between steps and sgemm keeps up (tied at up to 16 rows, ahead from 24); above it (the
# 57M model's 220 MiB) they are read from memory every step, where the kernel wins at every size
MIN_MODEL_WEIGHT_ELEMENTS = 1 << 24

_OP: list[bool] = []  # once per process: whether batchgen::linear is loaded and set up


class NativeLinear(nn.Linear):
    """nn.Linear whose forward is the `batchgen::linear` operator (install_native_linears sets the class)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchgen.linear(input, self.weight, self.bias)


def install_native_linears(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Route `model`'s eligible linears through the kernel; how many were. Eligible: exactly
    nn.Linear (not a subclass: quantized or adapter layers keep their own forward), float32 on the
    CPU, a contiguous weight, in a model whose eligible weights hold MIN_MODEL_WEIGHT_ELEMENTS or
    more. None where the kernels or the operator cannot be built (logged once)."""
    if device.type != "cpu" or dtype != torch.float32:
        return 0
    eligible = [m for m in model.modules() if type(m) is nn.Linear and _eligible(m.weight)]
    elements = sum(m.weight.numel() for m in eligible)
    if not eligible or elements < MIN_MODEL_WEIGHT_ELEMENTS or not load_op():
        return 0
    for module in eligible:
        module.__class__ = NativeLinear
    mib = elements * 4 / 2**20
    logger.info("native linears: %d layers (%.0f MiB of weights) at up to %d rows", len(eligible), mib, MAX_ROWS)
    return len(eligible)


def _eligible(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.is_contiguous()


def load_op() -> bool:
    """batchgen::linear, built and loaded once per process; False (logged) where it cannot be."""
    if not _OP:
        _OP.append(_load_op())
    return _OP[0]


def _load_op() -> bool:
    kernels = native.load()
    lib = native_ops.load_op("batchgen_linear_op", OP_SOURCE, "linear layers run on torch's BLAS")
    if kernels is None or lib is None:
        return False
    setup = lib.batchgen_linear_op_setup
    setup.restype, setup.argtypes = None, [ctypes.c_void_p, ctypes.c_int64]
    setup(ctypes.cast(kernels.linear, ctypes.c_void_p), MAX_ROWS)
    return True


torch.library.define(OP_NAME, "(Tensor x, Tensor weight, Tensor? bias) -> Tensor")


@torch.library.register_fake(OP_NAME)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
