"""batchgen's attention as transformers sees it: the function registered as "batchgen_paged", and the
binding of each attention module to its backend and KV-cache layer.

Each attention module carries a LayerBinding (`bind_layers`) naming its engine's backend and its
layer index, so the function needs no global; it checks the call and hands the tensors on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from batchgen.engine.attention.backend import AttentionBackend
from batchgen.engine.attention.op import LayerCall

ATTN_IMPLEMENTATION = "batchgen_paged"
BINDING = "_batchgen_attention"  # the attribute each attention module carries


@dataclass(frozen=True)
class LayerBinding:
    backend: AttentionBackend
    layer: int  # the module's layer index: its K/V pool in backend.kv_caches


def bind_layers(model: torch.nn.Module, backend: AttentionBackend) -> int:
    """Bind every module with an int `layer_idx` (transformers' attention modules) to `backend`;
    returns how many. Why every such module: transformers passes the attention module to the
    function, and a decoder layer that also has `layer_idx` is harmless to bind (never passed)."""
    num_layers = len(backend.kv_caches)
    bound = 0
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or isinstance(idx, bool):
            continue
        if not 0 <= idx < num_layers:
            raise RuntimeError(f"{name}: layer_idx {idx} is outside the KV pool's {num_layers} layers")
        object.__setattr__(module, BINDING, LayerBinding(backend, idx))
        bound += 1
    if bound == 0:
        raise RuntimeError(f"{type(model).__name__}: no attention module with a layer_idx to bind to the KV pool")
    return bound


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    binding = getattr(module, BINDING, None)
    if binding is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is only usable inside batchgen's model runner "
            f"({type(module).__name__} is not bound to a KV pool layer)"
        )
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION}: attention sinks (s_aux) are not supported")
    if attention_mask is not None:
        raise NotImplementedError(
            f"{ATTN_IMPLEMENTATION}: {type(module).__name__} built its own attention mask; only causal "
            "(optionally sliding-window) attention is supported"
        )
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION}: non-causal attention ({type(module).__name__})")
    if query.shape[0] != 1:
        raise ValueError(f"{ATTN_IMPLEMENTATION} expects one packed row, got batch size {query.shape[0]}")
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    if not (window is None or isinstance(window, int)) or not (softcap is None or isinstance(softcap, (int, float))):
        raise NotImplementedError(f"{ATTN_IMPLEMENTATION}: sliding_window {window!r}, softcap {softcap!r} unknown")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    cap = None if softcap is None else float(softcap)
    call = LayerCall(binding.layer, float(scale), window, cap)
    out = binding.backend.call_layer(call, query[0], key[0], value[0])
    return out.unsqueeze(0), None


# Why no AttentionMaskInterface entry: transformers (5.x) skips mask construction entirely for an
# attention implementation that has no registered mask function (`_preprocess_mask_arguments`
# returns early), so the model never builds a [T, T] mask; our masks come from the backend's plan.
AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
