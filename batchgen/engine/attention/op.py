"""The paged attention as one opaque torch custom op, `batchgen::paged_attention`, and the handles
by which the op finds the engine it runs for.

Why an op: torch.compile fuses the modules around the attention only if the attention (Python
plans, KV pool writes) neither breaks the graph nor is traced. Why a handle and a layer index as
arguments: several engines may live in one process; each backend registers here (weakly) and each
layer is bound to (handle, layer) at load, so the graph holds two constants per layer. Why the lowest
free handle: the same engine gets the same constants in every process (and after an earlier engine
in the same one is dropped and collected), so inductor's graph cache serves its compiled graph instead of
compiling it again.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import NamedTuple, Protocol

import torch

OP_NAME = "batchgen::paged_attention"
# The C++ front of the CPU backend (cpu/front.py, csrc/attention_op.cpp): its schema and fake are
# here, so a graph can be traced before its library loads.
FRONT_OP_NAME = "batchgen::attention"


class LayerCall(NamedTuple):
    """One attention layer's call, as the model makes it: what every backend's layer takes beside the tensors."""

    layer: int  # the module's layer index: its K/V pool
    scale: float
    window: int | None  # transformers' sliding window (keys with q - kv < window); None: none
    softcap: float | None  # the logits' soft-capping (Gemma 2); None: none


class LayerRunner(Protocol):
    """What the op's body calls: a backend's run of one layer (attention/backend.AttentionBackend)."""

    raised: BaseException | None

    def run_layer(
        self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor: ...


_LIVE: weakref.WeakValueDictionary[int, LayerRunner] = weakref.WeakValueDictionary()
_REGISTERING = threading.Lock()


def register(backend: LayerRunner) -> int:
    """A handle for `backend`, valid while it lives: the lowest one no live backend holds."""
    with _REGISTERING:  # why: engines built in two threads must not take the same handle
        handle = next(h for h in itertools.count(1) if h not in _LIVE)
        _LIVE[handle] = backend
    return handle


def lookup(handle: int) -> LayerRunner:
    backend = _LIVE.get(handle)
    if backend is None:
        raise RuntimeError(f"{OP_NAME}: no live attention backend {handle} (its engine was dropped)")
    return backend


@torch.library.custom_op(OP_NAME, mutates_args=())
def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    backend: int,
    layer: int,
) -> torch.Tensor:
    """query [H, T, D], key/value [KVH, T, D] -> [T, H, D]; stores this step's K/V in the pool as a side effect.

    Why mutates_args=(): the pool is the backend's, and the output keeps the op in its place.
    Why the exception is kept: the C++ wrapper reports it only as "API call failed"; compiled_forward
    raises this one instead.
    """
    owner = lookup(backend)
    try:
        return owner.run_layer(LayerCall(layer, scale, window, softcap), query, key, value)
    except BaseException as exc:
        owner.raised = exc
        raise


def _out_shape(query: torch.Tensor, *_: object) -> torch.Tensor:
    """Both ops' fake: query [H, T, D] -> [T, H, D]."""
    return query.new_empty(query.shape[1], query.shape[0], query.shape[2])


paged_attention.register_fake(_out_shape)

torch.library.define(
    FRONT_OP_NAME,
    "(Tensor query, Tensor key, Tensor value, float scale, SymInt? window, float? softcap, int backend, int layer)"
    " -> Tensor",
)
torch.library.register_fake(FRONT_OP_NAME)(_out_shape)
