"""The paged attention as one opaque torch custom op, `batchgen::paged_attention`.

Why: `torch.compile` can fuse the unchanged transformers modules (RMSNorm, RoPE, SwiGLU,
residuals, projections) only if the attention in between neither breaks the graph nor is traced.
The attention reads a per-step ForwardContext (Python objects: decode groups, rows, chunks) and
writes the KV pool; as a custom op it is one node the compiler calls as is, with a fake
implementation that only says what shape it returns. Everything the op needs beyond its tensor
arguments comes from the context the model runner sets around the forward, never from the
compiled code, so nothing in the graph depends on (or is guarded on) a step's metadata.

Eager runs go through the same op, so both modes execute the very same attention code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

OP_NAME = "batchgen::paged_attention"
# The C++ front (csrc/attention_op.cpp, loaded by attention_front): the model's attention calls it
# instead once FRONT_READY[0] is set; it attends planned decode-only steps itself and hands every
# other call to OP_NAME. Its schema and fake are here, so a graph can be traced before it loads.
FRONT_OP_NAME = "batchgen::attention"
FRONT_READY = [False]  # a plain flag, for the model's traced attention call to read

# Set by attention.py at import: (query [H, T, D], key/value [KVH, T, D], scale, window, softcap) -> [T, H, D].
# Why a hook: attention.py imports this module, and the op must exist before any model is compiled.
_IMPL: list[Callable[..., torch.Tensor]] = []
# The last exception the op's body raised. Why kept: a graph compiled with the C++ wrapper reports
# an exception from a Python op only as "aoti_torch_call_dispatcher(...) API call failed"; the
# step's caller (compiled_forward) raises this one instead, so the message says what went wrong.
_RAISED: list[BaseException] = []


# The C++ front's own refusals, read the same way (set by attention_front): its message or None
FRONT_ERRORS: list[Callable[[], str | None]] = []


def take_raised() -> BaseException | None:
    """The exception the op (or the C++ front) raised since the last call (None: none), forgotten once taken."""
    raised = _RAISED[0] if _RAISED else None
    _RAISED.clear()
    message = FRONT_ERRORS[0]() if FRONT_ERRORS else None
    return RuntimeError(message) if raised is None and message else raised


def set_impl(impl: Callable[..., torch.Tensor]) -> None:
    _IMPL[:] = [impl]


@torch.library.custom_op(OP_NAME, mutates_args=())
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """query [H, T, D], key/value [KVH, T, D] -> [T, H, D]; stores this step's K/V in the pool as a side effect.

    Why mutates_args=(): the pool is not an argument (it lives in the step's context), and the
    output, which every later layer depends on, keeps the op in its place in the graph.
    Why no layer index: the layer is the op's call number within the forward (layers run in
    order; compiled_forward.check_layer_order checks it at load), so every layer's compiled code
    is the same graph, compiled once, instead of one graph per layer.
    """
    try:
        return _IMPL[0](query, key, value, scale, window, softcap)
    except BaseException as exc:
        _RAISED[:] = [exc]
        raise


@paged_attention.register_fake
def _out_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    return query.new_empty(query.shape[1], query.shape[0], query.shape[2])


torch.library.define(
    FRONT_OP_NAME, "(Tensor query, Tensor key, Tensor value, float scale, SymInt? window, float? softcap) -> Tensor"
)
torch.library.register_fake(FRONT_OP_NAME)(_out_shape)
