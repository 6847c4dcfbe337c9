"""A model's linear layers through the native kernels (csrc/skinny_linear.c, wide_linear.c, and for bf16
models skinny_linear_bf16.c) where they measured faster.

Why: a decode step multiplies a few rows (one per decoding sequence) by every weight matrix, so
its linears are bound by reading the weights once; skinny_linear.c reads each weight row once, in
place, against all rows, and wide_linear.c takes tens of rows with each weight broadcast into
vectors of rows. Against torch's BLAS they win on some machines and shapes and lose badly on others
(an AVX2-only CPU: 5-12x slower), so each layer takes the kernel only at the row counts where it was
measured faster for its shape on this machine (linear_calibration): where it never was, the layer
stays a plain nn.Linear.

How: each such nn.Linear's class becomes NativeLinear (same parameters, same module tree), whose
forward calls the operator `batchgen::linear` (csrc/linear_op.cpp, built against this torch on first
use) with the layer's bucket mask: one opaque node to torch.compile, which takes the kernel in the
mask's row buckets and at::linear in the others, so one compiled graph serves every step size. Why a
C++ operator: from a compiled graph a call costs 12.9 us through a Python custom op, 2.8 us through
this one (aten's own linear: 1.2 us). Where the operator cannot be built (no C++ compiler,
BATCHGEN_NATIVE=0) the linears stay as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections import defaultdict
from pathlib import Path
from typing import cast

import torch
from torch import nn

from batchgen.engine.cpu import linear_calibration, native, packed_linear

logger = logging.getLogger(__name__)

OP_NAME = "batchgen::linear"  # its CPU implementation: csrc/linear_op.cpp (native.OPERATORS)
EVERY_BUCKET = (1 << 62) - 1  # a mask that gives the kernel every row count (tests)


class NativeLinear(nn.Linear):
    """nn.Linear whose forward is the `batchgen::linear` operator (install_native_linears sets the class)."""

    buckets: int  # row buckets the kernel takes (bit b: rows in (2^(b-1), 2^b]); install_native_linears sets it

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchgen.linear(input, self.weight, self.bias, self.buckets)


def install_native_linears(
    model: nn.Module, device: torch.device, dtype: torch.dtype, masks: dict[str, int] | None = None
) -> int:
    """Route `model`'s eligible linears through the kernel at the row buckets where it measured
    faster for their shape and dtype (or `masks`, by shape key, when given); how many were. Eligible:
    exactly nn.Linear (not a subclass: quantized or adapter layers keep their own forward), float32 or
    bfloat16 (the bf16 twin, measured against torch's bf16 linear) as the model is, on the CPU, a
    contiguous weight. A bf16 model's layers first go to packed_linear, which packs the weights of the
    shapes where that measured faster (AVX512-BF16 builds only; not when `masks` is given); the rest are
    routed as above. None where the kernel or the operator cannot be built (logged once)."""
    if device.type != "cpu" or dtype not in native.KERNEL_DTYPES:
        return 0
    eligible = [m for m in model.modules() if type(m) is nn.Linear and _eligible(m.weight, dtype)]
    if not eligible or not load_op():
        return 0
    library = native.STATES["linear"].path or Path("batchgen_linear")
    count = len(eligible)
    if dtype == torch.bfloat16 and masks is None:  # AVX512-BF16 built: weights packed for it where measured faster
        eligible = packed_linear.pack_linears(model, eligible, library, kernel_linear)
    packed = count - len(eligible)
    groups: dict[str, list[nn.Linear]] = defaultdict(list)
    for module in eligible:
        groups[linear_calibration.shape_key(module.weight, module.bias)].append(module)
    if masks is None:
        layers = {key: [(m.weight.detach(), _bias(m)) for m in group] for key, group in groups.items()}
        masks = linear_calibration.masks(layers, kernel_linear, library)
    routed = 0
    for key, group in groups.items():
        for module in group if masks.get(key, 0) else []:
            module.__class__ = NativeLinear
            cast(NativeLinear, module).buckets = masks[key]
            routed += 1
    logger.info("native linears: %d of %d layers (row buckets by shape: %s)", routed, len(eligible), _describe(masks))
    return routed + packed


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.batchgen.linear(x, weight, bias, EVERY_BUCKET)


def _describe(masks: dict[str, int]) -> str:
    def rows(mask: int) -> str:
        taken = [b for b in linear_calibration.BUCKETS if mask >> b & 1]
        return "none" if not taken else ",".join(f"<={2**b}" for b in taken)

    return "; ".join(f"{key}: {rows(mask)}" for key, mask in masks.items())


def _eligible(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    return weight.dtype == dtype and weight.device.type == "cpu" and weight.is_contiguous()


@functools.cache
def load_op() -> bool:
    """batchgen::linear, built, loaded and set up once per process; False (logged) where it cannot be."""
    kernel = native.function("batchgen_linear")
    lib = native.library("batchgen_linear_op")
    if kernel is None or lib is None:
        return False
    setup = lib.batchgen_linear_op_setup
    setup.restype, setup.argtypes = None, [ctypes.c_void_p, ctypes.c_void_p]
    bf16 = native.function("batchgen_linear", torch.bfloat16)  # None: bf16 linears stay on torch
    setup(ctypes.cast(kernel, ctypes.c_void_p), None if bf16 is None else ctypes.cast(bf16, ctypes.c_void_p))
    vnni = native.vnni_linear()  # None: no AVX512-BF16 build, no weight is packed
    if vnni is not None:
        packed_setup = lib.batchgen_packed_linear_op_setup
        packed_setup.restype, packed_setup.argtypes = None, [ctypes.c_void_p]
        packed_setup(ctypes.cast(vnni["linear"], ctypes.c_void_p))
    return True


torch.library.define(OP_NAME, "(Tensor x, Tensor weight, Tensor? bias, int buckets) -> Tensor")


@torch.library.register_fake(OP_NAME)
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, buckets: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
