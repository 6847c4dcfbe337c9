"""What a model's config allows the engine, read without torch: the longest sequence it may hold.

Why apart from models.py: `batchgen validate` checks a job's engine.max_model_len against the
model before any work, and importing models.py (transformers' modeling code) costs ~1 s there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class UnsupportedModelError(ValueError):
    """The model (or one of its features) cannot be run exactly by the paged engine."""


def refuse(config: PretrainedConfig, feature: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"model_type {config.model_type!r}: {feature} is not supported by batchgen's engine")


def _rope_parameter_sets(config: PretrainedConfig) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [params]
    return [p for p in params.values() if isinstance(p, dict)]  # one set per layer type


def resolve_max_model_len(config: PretrainedConfig, requested: int | None) -> int:
    """The longest sequence (prompt + output) the engine will hold; checked against RoPE scaling
    (dynamic-NTK and LongRoPE follow the longest position in a packed batch: another sequence's)."""
    text = config.get_text_config()
    limit = getattr(text, "max_position_embeddings", None)
    max_len = requested if requested is not None else limit
    if not isinstance(max_len, int) or max_len < 1:
        raise ValueError("max_model_len must be set (>= 1): the model config has no max_position_embeddings")
    if requested is not None and limit is not None and requested > limit:
        raise ValueError(f"max_model_len={requested} exceeds the model's max_position_embeddings={limit}")
    for params in _rope_parameter_sets(text):
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if "dynamic" in rope_type and limit is not None and max_len > limit:
            raise refuse(config, f"dynamic RoPE beyond max_position_embeddings={limit}")
        switch = params.get("original_max_position_embeddings")
        if rope_type == "longrope" and switch is not None and max_len > switch:
            raise refuse(
                config,
                f"LongRoPE with max_model_len={max_len} > original_max_position_embeddings={switch} "
                f"(pass max_model_len<={switch})",
            )
    return max_len
