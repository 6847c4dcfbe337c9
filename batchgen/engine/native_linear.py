"""A model's linear layers through the native kernels (csrc/skinny_linear.c, wide_linear.c) where they beat the BLAS.

Why: a decode step multiplies a few rows (one per decoding sequence) by every weight matrix, so
its linears are bound by reading the weights once. float32 sgemm on nn.Linear's [out, in] weights
is far from that at 4-32 rows; skinny_linear.c reads each weight row once, in place (no packed
copy), against all rows, overlapping the reads with the arithmetic (the 57M model's 56 linears at 8
rows: 16.1 -> 9 ms; benchmarks/RESULTS.md, issue 11's seventh pass). From 24 rows the multiply-adds
bound a call instead, and wide_linear.c takes it: x transposed once, each weight broadcast into
vectors of 16 rows, no sums across lanes (64 rows on an EPYC host: 57-62 -> 38-40 ms; the twelfth
pass). How far the kernels reach depends on the BLAS they replace (Reach, machine_reach): with
MKL on an Intel CPU, decode sizes in large models only; with MKL on another maker's CPU, where it
runs well below these kernels, every linear at every size.

How: each eligible nn.Linear's class becomes NativeLinear (same parameters, same module tree),
whose forward calls the operator `batchgen::linear` (csrc/linear_op.cpp, built against this torch
on first use): one opaque node to torch.compile, which takes the kernels at up to the layer's
max_rows rows and at::linear above, so one compiled graph serves every step size. Why a C++
operator: from a compiled graph a call costs 12.9 us through a Python custom op, 2.8 us through
this one (aten's own linear: 1.2 us); the Python op's share was 0.65 ms of a 57M decode step.
Where the operator cannot be built (no C++ compiler, BATCHGEN_NATIVE=0) the linears stay as they are.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from batchgen.engine import native, native_ops

logger = logging.getLogger(__name__)

OP_NAME = "batchgen::linear"  # its CPU implementation: OP_SOURCE
OP_SOURCE = Path(__file__).parent / "csrc" / "linear_op.cpp"


@dataclass(frozen=True)
class Reach:
    """Which float32 linears the kernels take on a machine; the rest stay on torch's BLAS."""

    max_rows: int  # calls of up to this many rows (more: the BLAS)
    min_model_elements: int  # only in models whose eligible weights hold this many elements or more
    why: str


# Where the BLAS is Intel's MKL on an Intel CPU (measured on a Xeon, the seventh pass): the kernels at
# up to 64 rows (max_num_seqs on the CPU: decode steps), where on the 57M model's linears they tied
# sgemm at 1-2 rows and beat it at 4-64; and only in models of 64 MiB of float32 linear weights or
# more. Below that (the demo model's 16 MiB) the weights stay in cache between steps and sgemm kept up
# (tied at up to 16 rows, ahead of skinny_linear.c from 24); above it (the 57M model's 220 MiB) they are
# read from memory every step, where the kernels win at every decode size.
DECODE_SIZES = Reach(64, 1 << 24, "decode sizes, in models of 64 MiB of weights or more")
# Where the BLAS is MKL on an x86 CPU of another maker, MKL's sgemm reached 92-160 GFLOPS on an AMD
# EPYC host where wide_linear.c reached 130-196 (two cores, peak ~220): the kernels won at every size
# measured, 8 to 2,048 rows, on the demo model's in-cache weights too (64 rows: 7.0 -> 3.9 ms a step;
# 2,048 rows: 116 -> 99 ms; the 57M model's: 1,450 -> 1,148 ms; benchmarks/RESULTS.md, twelfth pass).
EVERY_SIZE = Reach(1 << 62, 0, "every size: torch's BLAS is MKL, on a CPU not made by Intel")

_OP: list[bool] = []  # once per process: whether batchgen::linear is loaded and set up


def machine_reach() -> Reach:
    """EVERY_SIZE where torch's BLAS is MKL and the CPU an x86 one not made by Intel, else DECODE_SIZES."""
    vendor = native.cpu_vendor()
    mkl = torch.backends.mkl.is_available()
    return EVERY_SIZE if mkl and vendor is not None and vendor != "GenuineIntel" else DECODE_SIZES


class NativeLinear(nn.Linear):
    """nn.Linear whose forward is the `batchgen::linear` operator (install_native_linears sets the class)."""

    max_rows: int  # the most rows a call gives the kernels (more: torch's BLAS); install_native_linears sets it

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchgen.linear(input, self.weight, self.bias, self.max_rows)


def install_native_linears(
    model: nn.Module, device: torch.device, dtype: torch.dtype, reach: Reach | None = None
) -> int:
    """Route `model`'s eligible linears through the kernels as far as `reach` (default: this machine's)
    says; how many were. Eligible: exactly nn.Linear (not a subclass: quantized or adapter layers keep
    their own forward), float32 on the CPU, a contiguous weight. None where the kernels or the operator
    cannot be built (logged once)."""
    if device.type != "cpu" or dtype != torch.float32:
        return 0
    reach = reach or machine_reach()
    eligible = [m for m in model.modules() if type(m) is nn.Linear and _eligible(m.weight)]
    elements = sum(m.weight.numel() for m in eligible)
    if not eligible or elements < reach.min_model_elements or not load_op():
        return 0
    for module in eligible:
        module.__class__ = NativeLinear
        cast(NativeLinear, module).max_rows = reach.max_rows
    mib = elements * 4 / 2**20
    logger.info("native linears: %d layers (%.0f MiB of weights) at %s", len(eligible), mib, reach.why)
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
    setup.restype, setup.argtypes = None, [ctypes.c_void_p]
    setup(ctypes.cast(kernels.linear, ctypes.c_void_p))
    return True


torch.library.define(OP_NAME, "(Tensor x, Tensor weight, Tensor? bias, int max_rows) -> Tensor")


@torch.library.register_fake(OP_NAME)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
