"""The model forward of a step, optionally with torch.compile (engine.compile), tokens padded a little.

Why: on a small model Python dispatch of the unchanged transformers modules dominates; compiled,
inductor fuses them around the paged attention, one opaque custom op (attention/op). One
dynamic-shape graph serves every token count (padded to TOKEN_MULTIPLE; padded tokens write the
KV pool's trash slot) and every number of logit rows (at least MIN_KEEP).

A vision-language model (engine/vision) is compiled the same way: its eager `step_embeddings`
(the token embeddings with the step's image embeddings spliced in, and its M-RoPE positions
[3, T] where the family has them) runs first, outside the graph, and the graph takes the
embeddings instead of the ids. So a step with images and a decode step without any take one
graph, and what a step splices never becomes a guard or a baked-in constant.
"""

from __future__ import annotations

import logging
import re
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from transformers import PreTrainedModel

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.api.platform import CompilePolicy

# (input ids [T], positions [T]) -> (input embeddings [T, hidden], positions [T] or [3, T])
Splice = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

logger = logging.getLogger(__name__)

# why padded: a count of 1 would be specialised (a second graph), and aligned sizes vectorise
TOKEN_MULTIPLE = 8
MIN_KEEP = 2  # logit rows of a compiled call: fewer are padded (see StepForward.padded_rows)


def bucket(n: int, cap: int | None = None) -> int:
    """The padded token count for `n` (>= 1): the next multiple of TOKEN_MULTIPLE, but not above `cap`
    when n <= cap (cap: the step's token budget)."""
    size = -(-n // TOKEN_MULTIPLE) * TOKEN_MULTIPLE
    return min(size, cap) if cap is not None and n <= cap else size


@dataclass
class CompileStats:
    """What compiling cost: seconds spent in first calls of new shapes, and the shapes seen."""

    seconds: float = 0.0
    graphs: int = 0  # dynamo graphs compiled (all layers share theirs)
    shapes: set[tuple[int, int]] = field(default_factory=set)  # (tokens, logits kept) of the compiling calls

    def as_dict(self) -> dict[str, float | int]:
        return {"compile_seconds": round(self.seconds, 2), "compiled_graphs": self.graphs}


def check_layer_order(model: PreTrainedModel) -> None:
    """Every attention module of decoder layer i (the ModuleList as long as the config's layer count)
    has layer_idx i: a module's layer_idx names its KV pool (attention/interface.bind_layers), so no
    two decoder layers may share one."""
    num = model.config.get_text_config().num_hidden_layers
    layers = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == num), None)
    if layers is None:
        raise RuntimeError(f"{type(model).__name__}: no ModuleList of its {num} decoder layers found to compile")
    for i, layer in enumerate(layers):
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

    Why the whole model as one graph: compiled layer by layer, every layer call paid dynamo's
    guards and lost to eager (benchmarks/RESULTS.md, fourth pass); one graph is checked once per
    step and fuses everything around the attention op. The price, a compile once per process and
    model (5-20 s), is counted in `stats`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: ResolvedConfig,
        take_raised: Callable[[], BaseException | None],
        on_compiled: Callable[[], None],
        policy: CompilePolicy,
    ) -> None:
        """`config`: compile, compile_fallback ("auto": a model that fails to compile runs eager), the
        token budget. `take_raised`: the attention's last exception, raised for the graph's "API call failed"."""
        self.model = model
        self.take_raised = take_raised
        self.on_compiled = on_compiled
        self.policy = policy
        self.compile = config.compile
        self.max_tokens = config.max_num_batched_tokens
        self.fallback = config.compile_fallback
        self.stats = CompileStats()
        # a VLM's eager splice before the (compiled) language model; None: a text model takes ids
        self.splice: Splice | None = getattr(model, "step_embeddings", None)
        check_layer_order(model)
        self._run = self._logits
        if self.compile:
            logger.info(
                "torch.compile: compiling the model's forward; its first steps take ~5-20 s, once per "
                "process (engine.compile: false runs it eager)"
            )
            options = self.policy.options()
            if hasattr(torch._dynamo.types, "GuardFilterEntry"):  # why: guard filters are new in torch 2.7
                options["guard_filter_fn"] = partial(_argument_guards, self.policy.drops_guard)
            # why not dynamic=True: it is this same setting, patched in and out by dynamo on every call
            self._run = torch.compile(_own_code(self._logits), fullgraph=True, options=options)
            self._settings = _tracing_settings()

    def padded_tokens(self, n: int) -> int:
        return bucket(n, self.max_tokens) if self.compile else n

    def padded_rows(self, n: int) -> int:
        """Logit rows to ask for when `n` are wanted: at least MIN_KEEP when compiled, since a
        size-1 dimension is specialised (a second graph). The extra rows are the caller's to drop."""
        return max(n, MIN_KEEP) if self.compile else max(n, 1)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """input_ids [T], positions [T] (M-RoPE: [3, T]), keep [K] -> logits [K, vocab] (model dtype)."""
        if self.splice is not None:  # a VLM: embeddings (images spliced in) and its positions, eager
            input_ids, positions = self.splice(input_ids, positions)
        if not self.compile:
            return self._run(input_ids, positions, keep)  # the eager forward (a benchmark may wrap it)
        if not self.policy.matches():
            return self._logits(input_ids, positions, keep)
        graphs, began = _unique_graphs(), time.perf_counter()
        self.take_raised()
        revert = self._settings()
        try:
            out = self._run(_at_storage_start(input_ids), _at_storage_start(positions), _at_storage_start(keep))
        except torch._dynamo.exc.TorchDynamoException as exc:  # raised while tracing or compiling
            if not self.fallback:
                raise
            # why safe to rerun: compiling fails before the graph runs, so nothing was written yet
            logger.warning("torch.compile failed for %s; running eager from now on: %s", type(self.model).__name__, exc)
            self.compile, self._run = False, self._logits
            return self._logits(input_ids, positions, keep)
        except RuntimeError as exc:
            raised = self.take_raised()  # the attention's own error, not the C++ wrapper's
            if raised is None:
                raise
            raise raised from exc
        finally:
            revert()
        compiled = _unique_graphs() - graphs
        if compiled:  # why: this call compiled; its time is (mostly) compile time
            self.stats.seconds += time.perf_counter() - began
            self.stats.shapes.add((input_ids.shape[0], keep.shape[0]))
            self.stats.graphs += compiled
            tokens, seconds = input_ids.shape[0], self.stats.seconds
            logger.info("compiled %d graph(s) at %d tokens (%.1f s of compiling so far)", compiled, tokens, seconds)
            self.on_compiled()
        return out

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """tokens: ids [T] or (a VLM's) embeddings [T, hidden]; positions [T] or [3, T] -> [K, vocab]."""
        pos = positions[None] if positions.dim() == 1 else positions[:, None]  # [1, T] or [3, 1, T]
        if tokens.dim() == 1:
            out = self.model(input_ids=tokens[None], position_ids=pos, logits_to_keep=keep, use_cache=False)
        else:
            out = self.model(inputs_embeds=tokens[None], position_ids=pos, logits_to_keep=keep, use_cache=False)
        return out.logits[0]


def _at_storage_start(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it where it is a view into a larger buffer.

    Why: dynamo guards on a view's base and storage offset; on CUDA the inputs are views of the
    staging buffer at offsets that change step by step, and each new layout compiled again mid-job."""
    return t if t.storage_offset() == 0 and not t._is_view() else t.clone()


def _tracing_settings() -> Any:
    """dynamo's settings around each call (a change that returns its revert): every dimension
    dynamic, Python floats specialised (why: the model's never change; unspecialised, each became a
    graph input converted on every call, ~40 us a step)."""
    config: Any = torch._dynamo.config
    changes = {"assume_static_by_default": False, "specialize_float": True}
    if hasattr(config, "_make_closure_patcher"):  # dynamo's own cheap patcher, what it uses for `dynamic`
        return config._make_closure_patcher(**changes)
    patch = config.patch(**changes)

    def change() -> Any:
        patch.__enter__()
        return lambda: patch.__exit__(None, None, None)

    return change


def _own_code(method: Any) -> Any:
    """`method` bound to its instance through a function with a code object of its own (dynamo
    keeps its entries on the code object: its cache then only sees this instance; _argument_guards)."""
    fn = method.__func__
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__qualname__ = fn.__qualname__
    return types.MethodType(own, method.__self__)


_NAMES_SELF = re.compile(r"\bself\b")


def _argument_guards(drops: Callable[[Any], bool], entries: list[Any]) -> list[bool]:
    """dynamo's guard filter: keep the guards on the call's tensor arguments and ambient state;
    drop those on the StepForward, its model and their classes, on module globals, and those the
    device's policy `drops`.

    Why sound: the code object is this instance's own (_own_code), a loaded model and the libraries
    are never changed, and parameters are graph inputs, so those guards could never fail; checking
    them (~560 for the demo model) cost ~0.1-0.2 ms of every step.
    """
    return [not (entry.is_global or _NAMES_SELF.search(entry.name) or drops(entry)) for entry in entries]
