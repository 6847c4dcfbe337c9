"""A bf16 model's linears on weights packed once for AVX512-BF16 (csrc/vnni_linear_bf16.c), where measured faster.

Why: a bf16 decode step on a CPU without AMX is mostly its linears at 16-64 rows, and oneDNN's bf16
linear runs those at 9-31% of the machine's bf16 matmul peak (benchmarks/RESULTS.md, issue 46, third
pass): fed nn.Linear's [out, in] weight it reorders it for vdpbf16ps on every call. Packed once, at
load, into the pairs-interleaved-by-column layout vdpbf16ps reads, the kernel does no such work
(issue 46, fourth pass: 1.3-6x oneDNN on most shapes at 16-32 rows, about on par from 64 rows up).

How: per bf16 weight shape, the kernel on packed copies of that shape's weights is timed against
what the layer runs otherwise (the faster, per row count, of torch's bf16 linear and the skinny bf16
kernel), over weights read from memory, at decode row counts (ROWS); the shape is
packed only where the kernel's summed best time beats the other's by MARGIN and loses at no row
count by more than 1 / MARGIN. The packed weight REPLACES the layer's: the layer becomes
PackedLinear (still an nn.Linear for in/out features and adapters; its `weight` parameter is gone,
the buffer `packed` holds the same bytes, plus zero padding to whole panels of columns and an even
in-features), and every call of it, at any row count, is the operator batchgen::packed_linear.
A weight shared with another module (a tied LM head) is never packed: its other user needs it as
it is. A host whose linear library was built without AVX512-BF16 (no such CPU, an AVX2 build)
never packs (native.vnni_linear is None), nor does a process with BATCHGEN_PACKED_LINEAR=0 (for A/B
measurements and as an escape hatch). Cached per machine like linear_calibration's masks.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from batchgen.engine.cpu import native
from batchgen.engine.cpu.choice_cache import choice_path, read_choice, write_once
from batchgen.engine.cpu.linear_calibration import MARGIN, best_of, shape_key

logger = logging.getLogger(__name__)

OP_NAME = "batchgen::packed_linear"
DISABLE_ENV = "BATCHGEN_PACKED_LINEAR"  # "0": no weight is packed in this process
ROWS = (1, 16, 32, 64)  # decode row counts the choice is timed at (larger: on par, see the docstring)
REPEATS = 3
COLD_BYTES = 64 << 20  # weights cycled per timing: past the L3 cache, as a model's step reads them
BUDGET_SECONDS = 20.0  # per model, once per machine: a shape left untimed is not packed (and timed next time)

Layer = tuple[torch.Tensor, torch.Tensor | None]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class PackedLinear(nn.Linear):
    """nn.Linear whose weight was packed for vdpbf16ps (buffer `packed`, flat bf16); pack_linears sets the class."""

    packed: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchgen.packed_linear(input, self.packed, self.bias, self.out_features)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [n, k] bf16 -> the packed layout (flat bf16; batchgen_vnni_pack)."""
    fns = native.vnni_linear()
    if fns is None:
        raise RuntimeError("the packed bf16 linear kernel is not built on this host")
    n, k = weight.shape
    out = torch.empty(fns["packed_size"](n, k), dtype=torch.bfloat16)
    if fns["pack"](n, k, weight.contiguous().data_ptr(), out.data_ptr(), native.threads()) != 0:
        raise RuntimeError(f"batchgen_vnni_pack refused a [{n}, {k}] weight")
    return out


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., k] @ w^T (+ bias) on w packed by pack (bf16 in and out, float32 sums)."""
    return torch.ops.batchgen.packed_linear(x, packed, bias, out_features)


def pack_linears(model: nn.Module, modules: Sequence[nn.Linear], library: Path, other: Linear) -> list[nn.Linear]:
    """Pack those of `modules` (bf16 nn.Linear of `model`) whose shape measured faster packed than
    both torch's linear and `other` (the skinny kernel, native_linear's); the rest."""
    if os.environ.get(DISABLE_ENV) == "0" or not modules or native.vnni_linear() is None:
        return list(modules)
    users = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    groups: dict[str, list[nn.Linear]] = {}
    for module in modules:
        if users[module.weight.data_ptr()] == 1:  # why: a tied weight's other user reads it unpacked
            groups.setdefault(shape_key(module.weight, module.bias), []).append(module)
    layers = {key: [(m.weight.detach(), _bias(m)) for m in group] for key, group in groups.items()}
    chosen = choices(layers, library, other)
    packed = [m for key, group in groups.items() if chosen.get(key) for m in group]
    for module in packed:
        replace_weight(module)
    if packed:
        logger.info("packed bf16 linears: %d layers (%s)", len(packed), ", ".join(k for k, v in chosen.items() if v))
    taken = {id(m) for m in packed}
    return [m for m in modules if id(m) not in taken]


def replace_weight(module: nn.Linear) -> None:
    """The layer's weight packed, in its place (the unpacked parameter is dropped)."""
    packed = pack(module.weight.detach())
    del module.weight
    module.__class__ = PackedLinear
    module.register_buffer("packed", packed)


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def choices(groups: Mapping[str, Sequence[Layer]], library: Path, other: Linear) -> dict[str, bool]:
    """Per shape key, whether its layers take the packed kernel: from the cache, else measured and cached."""
    deadline = time.monotonic() + BUDGET_SECONDS
    out = {}
    for key, layers in groups.items():
        path = choice_path("packed-linear", f"{library.name}\0{key}")
        cached = read_choice(path, "packed")
        if cached is None:
            timed = measure(layers, deadline, other)
            if timed is None:
                out[key] = False
                continue
            cached = write_once(path, "packed", {"packed": timed})
        out[key] = bool(cached)
    return out


def measure(layers: Sequence[Layer], deadline: float, other: Linear) -> bool | None:
    """Whether the packed kernel beat the unpacked path over (enough of) these layers; None: out of time."""
    weight = layers[0][0]
    per_layer = weight.numel() * weight.element_size()
    cold = list(layers[: max(2, -(-COLD_BYTES // per_layer))])
    packs = [(pack(w), b) for w, b in cold]
    n = weight.shape[0]
    ours_total = theirs_total = 0.0
    for rows in ROWS:
        if time.monotonic() > deadline:
            return None
        x = torch.randn(rows, weight.shape[1]).to(weight.dtype)
        ours, theirs = best_of(packs, x, lambda x, p, b: packed_linear(x, p, b, n), REPEATS), _unpacked(cold, x, other)
        if ours * MARGIN > theirs:
            return False
        ours_total, theirs_total = ours_total + ours, theirs_total + theirs
    return ours_total < MARGIN * theirs_total


def _unpacked(layers: Sequence[Layer], x: torch.Tensor, other: Linear) -> float:
    """The faster of torch's linear and `other` over these layers."""
    return min(best_of(layers, x, F.linear, REPEATS), best_of(layers, x, other, REPEATS))


torch.library.define(OP_NAME, "(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


@torch.library.register_fake(OP_NAME)
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
