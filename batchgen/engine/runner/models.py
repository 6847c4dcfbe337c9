"""Model loading and architecture support: what the paged engine can run exactly, and clear refusals.

A model runs unchanged under our attention function when its class supports transformers'
attention interface and nothing in it depends on more than causal (optionally sliding-window,
optionally soft-capped) attention over its own K/V. Everything else is refused here, at load,
with an error that names the feature, so it can never produce silently wrong text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import is_accelerate_available

from batchgen.engine.api.config import DEVICE_CHOICES, DEVICE_NAME
from batchgen.engine.api.dtype_rule import for_job
from batchgen.engine.attention.interface import ATTN_IMPLEMENTATION
from batchgen.engine.runner.model_limits import UnsupportedModelError as UnsupportedModelError  # re-exported
from batchgen.engine.runner.model_limits import refuse as _refuse
from batchgen.engine.runner.model_limits import resolve_max_model_len as resolve_max_model_len  # re-exported

logger = logging.getLogger(__name__)

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class KVSpec:
    """What one token costs in the KV pool."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


class DeviceError(ValueError):
    """The device is not a device name, or not present on this machine (the job side makes it exit 4)."""


def available_devices() -> list[str]:
    """The devices torch can use on this machine, e.g. ["cpu", "cuda:0", "cuda:1"]."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if torch.backends.mps.is_available():
        found.append("mps")
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        found += [f"xpu:{i}" for i in range(xpu.device_count())]
    return found


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto": cuda when available, else cpu. Anything else must be present on this machine."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    here = available_devices()
    if not DEVICE_NAME.fullmatch(device):
        raise DeviceError(
            f"device {device!r} is not a device name (use {DEVICE_CHOICES}); on this machine: " + ", ".join(here)
        )
    kind, _, index = device.partition(":")
    if not any(d == device or (not index and d.split(":")[0] == kind) for d in here):
        raise DeviceError(f"device {device!r} is not available on this machine; devices here: {', '.join(here)}")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, model_path: str | None = None) -> torch.dtype:
    """ "auto": engine/api/dtype_rule's answer for `device` and the checkpoint at `model_path`; else the dtype named."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return getattr(torch, for_job(dtype, str(device), model_path).dtype)


def check_config(config: PretrainedConfig) -> None:
    """Refuse, before any weights are read, what we know we cannot run exactly."""
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse(config, "an encoder-decoder architecture")
    if getattr(config, "vision_config", None) is not None or getattr(config, "audio_config", None) is not None:
        raise _refuse(
            config,
            "this multimodal model (images run on LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL and Gemma 3; "
            "load this one's text-only checkpoint instead)",
        )
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise _refuse(config, "loading with AutoModelForCausalLM (not a causal LM)")
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    if not getattr(model_cls, "_supports_attention_backend", False):
        name = getattr(model_cls, "__name__", str(model_cls))
        raise _refuse(config, f"{name} (it does not support transformers' attention interface)")
    text = config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or [])
    if not layer_types <= SUPPORTED_LAYER_TYPES:
        raise _refuse(config, f"layer types {sorted(layer_types - SUPPORTED_LAYER_TYPES)}")
    if getattr(text, "use_bidirectional_attention", False):
        raise _refuse(config, "bidirectional attention")
    if getattr(text, "attention_chunk_size", None) is not None:
        raise _refuse(config, "chunked attention (attention_chunk_size)")
    if getattr(text, "alibi", False):
        raise _refuse(config, "ALiBi position biases")


def check_model(model: PreTrainedModel) -> None:
    """Refuse features only visible on the built modules."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "sinks", None), torch.Tensor):
            raise _refuse(model.config, f"attention sinks (s_aux, module {name!r})")


def kv_spec(config: PretrainedConfig) -> KVSpec:
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return KVSpec(num_layers=text.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim)


# A pooling run never calls the causal LM's head, and a classifier's own head (`score`) is read
# apart (pooling/model.load_score_head): transformers' load report of these keys is expected there, not a fault.
_POOLING_MISSING = (r"^lm_head\.",)
_POOLING_UNEXPECTED = (r"^score\.",)


def _loader(config: PretrainedConfig, pooling: bool) -> Any:
    """AutoModelForCausalLM; for a pooling run, the config's causal-LM class told that the LM head
    may be missing (an embedding backbone, a classifier) and a `score` head unused. Every other
    missing or unexpected key is still reported."""
    if not pooling:
        return AutoModelForCausalLM
    cls: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # one class: check_config refused the rest
    missing = set(cls._keys_to_ignore_on_load_missing or ()) | set(_POOLING_MISSING)
    unexpected = set(cls._keys_to_ignore_on_load_unexpected or ()) | set(_POOLING_UNEXPECTED)
    attrs = {"_keys_to_ignore_on_load_missing": missing, "_keys_to_ignore_on_load_unexpected": unexpected}
    return type(cls.__name__, (cls,), {**attrs, "__module__": cls.__module__})


def load_model(path: str, device: torch.device, dtype: torch.dtype, pooling: bool = False) -> PreTrainedModel:
    """Load a local checkpoint with our attention implementation, refusing what we cannot run.

    Off the CPU the weights go straight to the device (`device_map`) when accelerate is installed,
    which transformers requires for that; else they are read into host memory and moved.
    `pooling`: the model serves embed / classify / score only (its LM head is never used).
    """
    config = AutoConfig.from_pretrained(path)
    check_config(config)
    direct = device.type != "cpu" and is_accelerate_available()
    placement = {"device_map": {"": device}} if direct else {}
    model: PreTrainedModel = _loader(config, pooling).from_pretrained(
        path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, **placement
    )
    check_model(model)
    model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() for its own models badly
    how = "straight to the device" if direct or device.type == "cpu" else "via host memory (no accelerate)"
    logger.info("loaded %s (%s) on %s as %s, weights %s", path, type(model).__name__, device, dtype, how)
    return model
