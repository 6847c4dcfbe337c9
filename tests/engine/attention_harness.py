"""A planned step run through a real attention backend, for the attention tests: a one-layer module
bound to a backend over the step's pool, the step set as its current plan."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from batchgen.engine.attention.backend import AttentionBackend
from batchgen.engine.attention.gather import GatheredBlocks
from batchgen.engine.attention.interface import bind_layers
from batchgen.engine.attention.metadata import ForwardContext


class Layer(torch.nn.Module):
    """An attention module as transformers passes it: it has a layer index, nothing else."""

    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx


@contextmanager
def running(ctx: ForwardContext, layer_idx: int = 0) -> Iterator[Layer]:
    """A module of layer `layer_idx` bound to a backend whose current step is `ctx` (planned already)."""
    pool = ctx.kv_caches[0][0]
    backend = AttentionBackend(ctx.kv_caches, pool.shape[1], pool.device, GatheredBlocks(pool.shape[1], pool.device))
    layer = Layer(layer_idx)
    bind_layers(layer, backend)
    with backend.running(ctx):
        yield layer


class DirectStager:
    """Each tensor straight to its device (the engine stages through its Transfers: planning.Stager)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stage(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.device)


CPU_STAGER = DirectStager(torch.device("cpu"))
