"""A bf16 model's linears on weights packed once for AVX512-BF16 (csrc/vnni_linear_bf16.c), where measured faster.

Why: a bf16 decode step on a CPU without AMX is mostly its linears at 16-64 rows, and oneDNN's bf16
linear runs those at 9-31% of the machine's bf16 matmul peak (benchmarks/RESULTS.md, issue 46, third
pass): fed nn.Linear's [out, in] weight it reorders it for vdpbf16ps on every call. Packed once, at
load, into the pairs-interleaved-by-column layout vdpbf16ps reads, the kernel does no such work
(issue 46, fourth pass: 1.3-6x oneDNN on most shapes at 16-32 rows, about on par from 64 rows up).

How: per bf16 weight shape, the kernel on packed copies of that shape's weights is timed against
what the layer runs otherwise (the faster, per row count, of torch's bf16 linear and the skinny bf16
kernel), over weights read from memory, at decode row counts (ROWS): single calls, in rounds that
take every row count and side in turn (so a busy spell of a shared host hits all of them alike); the
shape is packed where the kernel's summed best call beats the other's by MARGIN and loses at no row
count of 16 or more by more than VETO, a losing shape measured a second time before it is refused.
Why not the first rule (every row count within 1 / MARGIN, each side timed in one block): on a host
at load 6 it left h1024's MLP weights unpacked, where the kernel is 1.2-4x faster at 16-64 rows
(benchmarks/RESULTS.md, issue 46, fifth pass), and a choice is cached for good; CHOICE_FOLDER names the
rule, so choices made by an earlier one are measured again. The packed weight REPLACES the layer's: the layer becomes
PackedLinear (still an nn.Linear for in/out features and adapters; its `weight` parameter is gone,
the buffer `packed` holds the same bytes, plus zero padding to whole panels of columns and an even
in-features), and every call of it, at any row count, is the operator batchgen::packed_linear.
A weight shared with an nn.Embedding alone (a tied LM head: its vocabulary's rows are the embedding's)
is packed too where its shape is chosen, and the embedding becomes PackedEmbedding, which gathers its
rows from the same packed bytes (one copy, as before); why: at h1024 with a 16k tied vocabulary the
head is a fifth of a decode step's FLOPs and oneDNN ran it at 1/2-1/7 of the kernel's speed at 16-64
rows (issue 46, fifth pass). A weight shared any other way is never packed: its other user needs it
as it is. A host whose linear library was built without AVX512-BF16 (no such CPU, an AVX2 build)
never packs (native.vnni_linear is None), nor does a process with BATCHGEN_PACKED_LINEAR=0 (for A/B
measurements and as an escape hatch); with BATCHGEN_PACKED_LINEAR=1 every eligible shape (a tied head's
included) is packed without timing (A/B measurements). Cached per machine like linear_calibration's masks.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from batchgen.engine.cpu import native
from batchgen.engine.cpu.choice_cache import choice_path, interleaved_best, read_choice, write_once
from batchgen.engine.cpu.linear_calibration import MARGIN, shape_key

logger = logging.getLogger(__name__)

OP_NAME = "batchgen::packed_linear"
DISABLE_ENV = "BATCHGEN_PACKED_LINEAR"  # "0": no weight is packed in this process; "1": every eligible one
CHOICE_FOLDER = "packed-linear-v2"  # the cache folder of this rule's choices (v1: each side timed in one block)
ROWS = (1, 16, 32, 64)  # decode row counts the choice is timed at (larger: on par, see the docstring)
REPEATS = 5  # interleaved rounds (every row count and side in each), more where few layers are cycled:
CALLS = 24  # at least this many timed calls per side and row count (a 32k-vocabulary head: 2 layers, 12 rounds)
VETO = 2.0  # a shape that loses at any row count of 16+ by this factor stays unpacked, whatever its sum
COLD_BYTES = 64 << 20  # weights cycled per timing: past the L3 cache, as a model's step reads them
PANEL = 64  # output columns a panel of the packed layout holds (NR in csrc/vnni_linear_bf16.c; checked at pack)
BUDGET_SECONDS = 20.0  # per model, once per machine: a shape left untimed is not packed (and timed next time)

Layer = tuple[torch.Tensor, torch.Tensor | None]
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class PackedLinear(nn.Linear):
    """nn.Linear whose weight was packed for vdpbf16ps (buffer `packed`, flat bf16); pack_linears sets the class."""

    packed: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.batchgen.packed_linear(input, self.packed, self.bias, self.out_features)


class PackedEmbedding(nn.Embedding):
    """nn.Embedding whose weight is a tied head's, packed (buffer `packed`, shared with that PackedLinear)."""

    packed: torch.Tensor

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return packed_rows(self.packed, input, self.embedding_dim)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """ids [...] -> rows [..., k] of the weight packed by pack: row r is panel r // NR's column r % NR,
    its k elements held in (k + 1) // 2 pairs, NR * 2 elements apart."""
    panel = PANEL
    pairs = (k + 1) // 2
    panels = packed.view(-1, pairs, panel, 2)  # [panels, pairs, NR, 2]
    rows = panels[ids // panel, :, ids % panel]  # [..., pairs, 2]
    return rows.reshape(*ids.shape, 2 * pairs)[..., :k]


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
    setting = os.environ.get(DISABLE_ENV)
    fns = native.vnni_linear()
    if setting == "0" or not modules or fns is None:
        return list(modules)
    if fns["panel"]() != PANEL:  # why: a kernel built with another -DNR would be misread; run unpacked
        logger.warning(
            "packed bf16 linears off: the kernel's panel is %d columns, this module reads %d", fns["panel"](), PANEL
        )
        return list(modules)
    users = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    embeddings = {id(m.weight): m for m in model.modules() if type(m) is nn.Embedding and m.max_norm is None}
    groups: dict[str, list[nn.Linear]] = {}
    tied: dict[int, nn.Embedding] = {}
    for module in modules:
        shared = users[module.weight.data_ptr()] - 1
        if shared == 1 and id(module.weight) in embeddings:  # a tied head: its embedding gathers from the packing
            tied[id(module)] = embeddings[id(module.weight)]
        elif shared:  # why: any other user of a shared weight reads it unpacked
            continue
        groups.setdefault(shape_key(module.weight, module.bias), []).append(module)
    layers = {key: [(m.weight.detach(), _bias(m)) for m in group] for key, group in groups.items()}
    chosen = dict.fromkeys(layers, True) if setting == "1" else choices(layers, library, other)
    packed = [m for key, group in groups.items() if chosen.get(key) for m in group]
    for module in packed:
        replace_weight(module, tied.get(id(module)))
    if packed:
        logger.info("packed bf16 linears: %d layers (%s)", len(packed), ", ".join(k for k, v in chosen.items() if v))
    taken = {id(m) for m in packed}
    return [m for m in modules if id(m) not in taken]


def replace_weight(module: nn.Linear, embedding: nn.Embedding | None = None) -> None:
    """The layer's weight packed, in its place (the unpacked parameter is dropped); a tied
    `embedding` of the same weight reads its rows from the packed one."""
    packed = pack(module.weight.detach())
    del module.weight
    module.__class__ = PackedLinear
    module.register_buffer("packed", packed)
    if embedding is not None:
        del embedding.weight
        embedding.__class__ = PackedEmbedding
        embedding.register_buffer("packed", packed)


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()


def choices(groups: Mapping[str, Sequence[Layer]], library: Path, other: Linear) -> dict[str, bool]:
    """Per shape key, whether its layers take the packed kernel: from the cache, else measured and cached."""
    deadline = time.monotonic() + BUDGET_SECONDS
    out = {}
    for key, layers in groups.items():
        path = choice_path(CHOICE_FOLDER, f"{library.name}\0{key}")
        cached = read_choice(path, "packed")
        if cached is None:
            timed = measure(layers, deadline, other)
            if timed is None:
                out[key] = False
                continue
            cached = write_once(path, "packed", timed)
        out[key] = bool(cached)
    return out


def measure(layers: Sequence[Layer], deadline: float, other: Linear) -> dict[str, Any] | None:
    """Whether the packed kernel beat the unpacked path over (enough of) these layers ("packed"), with
    the best call's microseconds of each side per row count and the load average (the cached record,
    so a choice can be read back and judged); where it lost, measured once more and judged on the
    better call of the two (as cpu/backend.native_wins does); None: out of time."""
    weight = layers[0][0]
    per_layer = weight.numel() * weight.element_size()
    cold = list(layers[: max(2, -(-COLD_BYTES // per_layer))])
    packs = [(pack(w), b) for w, b in cold]
    n = weight.shape[0]
    sides: dict[str, tuple[Sequence[Layer], Linear]] = {
        "packed": (packs, lambda x, p, b: packed_linear(x, p, b, n)),
        "torch": (cold, F.linear),
        "other": (cold, other),
    }
    inputs = {rows: torch.randn(rows, weight.shape[1]).to(weight.dtype) for rows in ROWS}
    # why: CALLS is for weights up to a 32k head, whose calls vary most; past 4 x COLD_BYTES (a tied head
    # of a 128k vocabulary: 0.5 GB) every call streams from memory, and 25 rounds would outlast the budget
    rounds = REPEATS if per_layer > 4 * COLD_BYTES else max(REPEATS, -(-CALLS // len(cold)))
    best = interleaved(sides, inputs, deadline, rounds)
    if best is None:
        return None
    record = _verdict(best)
    if not record["packed"]:  # a second measurement first: a busy spell can cover one whole measurement
        again = interleaved(sides, inputs, deadline, rounds)
        if again is None:
            return None
        record = _verdict({rows: {k: min(t, again[rows][k]) for k, t in times.items()} for rows, times in best.items()})
    return record


def _verdict(best: Mapping[int, Mapping[str, float]]) -> dict[str, Any]:
    """The choice from each side's best call per row count, with those microseconds and the load."""
    record: dict[str, Any] = {"load": round(os.getloadavg()[0], 1), "us": {}}
    ours_total = theirs_total = 0.0
    veto = False
    for rows, times in best.items():
        record["us"][rows] = {name: round(s * 1e6, 1) for name, s in times.items()}
        ours, theirs = times["packed"], min(times["torch"], times["other"])
        # why no veto at 1 row: every side streams the weight from memory there, and noise is all that differs
        veto = veto or (rows > 1 and ours > VETO * theirs)
        ours_total, theirs_total = ours_total + ours, theirs_total + theirs
    return {"packed": not veto and ours_total < MARGIN * theirs_total, **record}


def interleaved(
    sides: Mapping[str, tuple[Sequence[Layer], Linear]],
    inputs: Mapping[int, torch.Tensor],
    deadline: float,
    rounds: int,
) -> dict[int, dict[str, float]] | None:
    """Per row count, the best seconds of one call of each side over every layer (choice_cache's
    interleaved_best: every row count, side and layer in each round); None past the deadline. Why
    single calls: on a shared host a call, rather than a pass, is what is sometimes left alone
    (RESULTS.md, issue 46, fifth pass)."""
    calls = {
        (rows, name, j): functools.partial(fn, x, weight, bias)
        for rows, x in inputs.items()
        for name, (layers, fn) in sides.items()
        for j, (weight, bias) in enumerate(layers)
    }
    timed = interleaved_best(calls, rounds, deadline)
    if timed is None:
        return None
    best = {rows: dict.fromkeys(sides, float("inf")) for rows in inputs}
    for (rows, name, _), seconds in timed.items():
        best[rows][name] = min(best[rows][name], seconds)
    return best


torch.library.define(OP_NAME, "(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")


@torch.library.register_fake(OP_NAME)
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
