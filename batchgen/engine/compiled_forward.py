"""The model forward of a step, optionally with torch.compile (engine.compile), tokens padded a little.

Why: on a small model the unchanged transformers modules run one small op at a time (RMSNorm,
RoPE, SwiGLU, residuals), and Python dispatch dominates. Compiled, inductor fuses them; the
paged attention stays one opaque custom op (attention_op), so the graph does not break.

Why so few compiled shapes: every decoder layer is compiled with dynamic shapes, so one graph
serves every layer and every token count (a second one only where layers differ, e.g. sliding
and full attention, or when the first call's token count equals a model dimension and gets
specialised). Token counts are padded to a multiple of TOKEN_MULTIPLE (a count of 1 would be
specialised; padded tokens write the KV pool's trash slot and are never read). The compile
time and the graphs compiled are counted here, for the benchmark and the logs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# Token counts are padded to a multiple of this: with dynamic shapes a new count needs no new
# graph, but a count of 1 would be specialised (a second graph), and aligned sizes vectorise.
TOKEN_MULTIPLE = 8
RECOMPILE_LIMIT = 64


def bucket(n: int, cap: int | None = None) -> int:
    """The padded token count for `n` (>= 1): the next multiple of TOKEN_MULTIPLE, but not above `cap`
    when n <= cap (cap: the step's token budget)."""
    size = -(-n // TOKEN_MULTIPLE) * TOKEN_MULTIPLE
    return min(size, cap) if cap is not None and n <= cap else size


def resolve_compile(setting: str | bool, device: torch.device) -> bool:
    """ "auto" -> off everywhere for now: measured on CPU (benchmarks/RESULTS.md), compiling changed
    a run by 0-7% on the demo and the 57M model (within run-to-run noise; attention and matrix
    products, three quarters of a decode step, are the same kernels either way), against ~5 s of
    compiling per process on a quiet machine (up to 140 s under load); on CUDA it is unmeasured.
    `true` turns it (and CUDA-graph decode) on."""
    if setting != "auto":
        return bool(setting)
    return False


@dataclass
class CompileStats:
    """What compiling cost: seconds spent in first calls of new shapes, and the shapes seen."""

    seconds: float = 0.0
    graphs: int = 0  # dynamo graphs compiled (all layers share theirs)
    shapes: set[tuple[int, int]] = field(default_factory=set)  # (tokens, logits kept) of the compiling calls

    def as_dict(self) -> dict[str, float | int]:
        return {"compile_seconds": round(self.seconds, 2), "compiled_graphs": self.graphs}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the ModuleList as long as the config's layer count (any architecture)."""
    config: Any = model.config
    num = config.get_text_config().num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num:
            return list(module)
    raise RuntimeError(f"{type(model).__name__}: no ModuleList of its {num} decoder layers found to compile")


def check_layer_order(model: torch.nn.Module) -> None:
    """Every attention module of decoder layer i has layer_idx i: the attention op finds a layer's
    KV pool by its call number in the forward, so layers must run (and be numbered) in order."""
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            idx = getattr(module, "layer_idx", i)
            if isinstance(idx, int) and idx != i:
                raise RuntimeError(
                    f"{type(model).__name__}: decoder layer {i} has {name or 'a module'} with layer_idx {idx}"
                )


def _unique_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class StepForward:
    """Runs the model on one packed step; compiled or eager, the same arguments and results.

    Why each decoder layer, with dynamic shapes, and not the whole model per bucket: measured on
    the shared 2-core machine, one static-shape graph of the whole demo model took ~110 s to
    compile under load, and a run meets dozens of (tokens, logits) shapes. Layers share their code,
    so one dynamic-shape graph serves every layer and every token count (two when layers differ,
    e.g. sliding and full attention); embeddings, final norm and lm_head stay eager.
    """

    def __init__(self, model: PreTrainedModel, compile: bool, max_tokens: int | None = None) -> None:
        self.model = model
        self.compile = compile
        self.max_tokens = max_tokens
        self.stats = CompileStats()
        check_layer_order(model)
        if compile:
            # why: every architecture's layers enter through transformers' one GradientCheckpointingLayer
            # __call__, so each model (and dtype) in a process adds its graphs to that one code object's
            # cache; the default limit of 8 would fail the fourth model of a test run or benchmark
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            for layer in decoder_layers(model):
                layer.compile(dynamic=True, fullgraph=True)

    def padded_tokens(self, n: int) -> int:
        return bucket(n, self.max_tokens) if self.compile else n

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T], keep [K] -> logits [K, vocab] (model dtype)."""
        if not self.compile:
            return self._eager(input_ids, positions, keep)
        graphs, began = _unique_graphs(), time.perf_counter()
        out = self._eager(input_ids, positions, keep)
        if _unique_graphs() != graphs:  # why: this call compiled; its time is (mostly) compile time
            self.stats.seconds += time.perf_counter() - began
            self.stats.shapes.add((input_ids.shape[0], keep.shape[0]))
            self.stats.graphs += _unique_graphs() - graphs
            logger.info(
                "compiled %d graph(s) at %d tokens (%.1f s of compiling so far)",
                _unique_graphs() - graphs,
                input_ids.shape[0],
                self.stats.seconds,
            )
        return out

    def _eager(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], logits_to_keep=keep, use_cache=False)
        return out.logits[0]
