"""Which modules of a model an adapter may target: the model's linear layers, by their names.

Why apart from spec: it needs the model's module tree. `check_modules` builds it from the config
alone on the meta device (no memory, no weights read), so `batchgen validate` can check an adapter
against a model folder before any work; `linear_modules` is the engine's list of the modules that
get LoRA slots (every linear but the LM head).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class TargetShape(Protocol):
    """What the check needs of an adapter's module (spec.ModuleLoRA has it): named here, not
    imported, so spec (which calls the check) and this module do not import each other."""

    @property
    def module(self) -> str: ...
    @property
    def in_features(self) -> int: ...
    @property
    def out_features(self) -> int: ...


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a linear layer (nn.Linear, or transformers' Conv1D whose
    weight is [in, out]); None for any other module."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        shape = cast("torch.Tensor", module.weight).shape
        return int(shape[0]), int(shape[1])
    return None


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> module of every linear layer that may carry an adapter (not the input embeddings,
    nor the output embeddings / LM head)."""
    excluded = {id(model.get_input_embeddings()), id(model.get_output_embeddings())}  # type: ignore[operator]
    return {
        name: module
        for name, module in model.named_modules()
        if name and id(module) not in excluded and linear_shape(module) is not None
    }


# A vision-language model's adapters serve its language model: the modules under this path (the
# VLM's own names, as peft saves them); its vision tower and projector run outside the step.
VLM_LANGUAGE_MODEL = "model.language_model."


@functools.lru_cache(maxsize=8)
def _model_modules(cls: Any, config_json: str) -> tuple[dict[str, tuple[int, int]], frozenset[str]]:
    """(linear name -> (in, out), every module name) of the model a config builds, on the meta
    device; of a vision-language model, the linears of its language model only."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    config = cls.from_dict(json.loads(config_json))
    vision = getattr(config, "vision_config", None) is not None
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_config(config)
    shapes = {name: linear_shape(m) for name, m in linear_modules(model).items()}
    if vision:
        shapes = {k: v for k, v in shapes.items() if k.startswith(VLM_LANGUAGE_MODEL)}
    return {k: v for k, v in shapes.items() if v is not None}, frozenset(n for n, _ in model.named_modules())


def model_modules(hf_config: PretrainedConfig) -> tuple[dict[str, tuple[int, int]], frozenset[str]]:
    cls: Any = type(hf_config)  # why Any: config classes hash by identity, mypy thinks not
    return _model_modules(cls, hf_config.to_json_string(use_diff=False))


def check_modules(modules: Iterable[TargetShape], hf_config: PretrainedConfig) -> str | None:
    """Why these LoRA modules cannot run on a model of `hf_config`, or None."""
    linears, names = model_modules(hf_config)
    for m in modules:
        if m.module not in names:
            return f"target module {m.module!r} is not in the model ({hf_config.model_type})"
        shape = linears.get(m.module)
        if shape is None and getattr(hf_config, "vision_config", None) is not None:
            why = "a vision-language model's adapters serve its language model"
            return f"target module {m.module!r} is not in the language model ({why})"
        if shape is None:
            return (
                f"target module {m.module!r} is not a linear layer of the model "
                "(embeddings and the LM head are not supported)"
            )
        if shape != (m.in_features, m.out_features):
            return (
                f"target module {m.module!r} is [{shape[0]} -> {shape[1]}] in the model but the adapter's "
                f"lora_A/lora_B are for [{m.in_features} -> {m.out_features}]"
            )
    return None
