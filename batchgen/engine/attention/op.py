"""The paged attention as one opaque torch custom op, `batchgen::paged_attention`, and the handles
by which the op finds the engine it runs for.

Why an op: `torch.compile` can fuse the unchanged transformers modules (RMSNorm, RoPE, SwiGLU,
residuals, projections) only if the attention in between neither breaks the graph nor is traced.
The attention reads its backend's per-step plan (Python objects: decode groups, rows, chunks) and
writes the KV pool; as a custom op it is one node the compiler calls as is, with a fake
implementation that only says what shape it returns.

Why a backend handle and a layer index as arguments: the op's body must reach the state of the
engine whose model is running (its KV pool, its step plan), and several engines may live in one
process. Each attention backend registers itself here and gets an integer handle; a layer's
attention module is bound to (handle, layer index) when the model loads (attention/interface),
so the compiled graph holds two constants per layer and nothing that depends on a step. The
table below maps handles to live backends (weakly: an engine that is gone is gone); it holds no
step state.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Protocol

import torch

OP_NAME = "batchgen::paged_attention"
# The C++ front of the CPU backend (cpu/front.py, csrc/attention_op.cpp): its schema and fake are
# here, so a graph can be traced before its library loads.
FRONT_OP_NAME = "batchgen::attention"


class LayerRunner(Protocol):
    """What the op's body calls: a backend's run of one layer (attention/backend.AttentionBackend)."""

    raised: BaseException | None

    def run_layer(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor: ...


_LIVE: weakref.WeakValueDictionary[int, LayerRunner] = weakref.WeakValueDictionary()
_IDS = itertools.count(1)


def register(backend: LayerRunner) -> int:
    """A handle for `backend`, valid while it lives."""
    handle = next(_IDS)
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

    Why mutates_args=(): the pool is not an argument (the backend holds it), and the output, which
    every later layer depends on, keeps the op in its place in the graph.
    Why the exception is kept on the backend: a graph compiled with the C++ wrapper reports an
    exception from a Python op only as "aoti_torch_call_dispatcher(...) API call failed"; the
    step's caller (compiled_forward) raises this one instead, so the message says what went wrong.
    """
    owner = lookup(backend)
    try:
        return owner.run_layer(layer, query, key, value, scale, window, softcap)
    except BaseException as exc:
        owner.raised = exc
        raise


@paged_attention.register_fake
def _out_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    backend: int,
    layer: int,
) -> torch.Tensor:
    return query.new_empty(query.shape[1], query.shape[0], query.shape[2])


def _front_shape(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    backend: int,
    layer: int,
    plan_cell: int,
) -> torch.Tensor:
    return _out_shape(query, key, value, scale, window, softcap, backend, layer)


torch.library.define(
    FRONT_OP_NAME,
    "(Tensor query, Tensor key, Tensor value, float scale, SymInt? window, float? softcap, int backend, int layer,"
    " int plan_cell) -> Tensor",
)
torch.library.register_fake(FRONT_OP_NAME)(_front_shape)
