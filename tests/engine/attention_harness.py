"""A planned step run through a real attention backend, for the attention tests: a one-layer module
bound to a backend over the step's pool, the step set as its current plan."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from batchgen.engine.attention.backend import AttentionBackend
from batchgen.engine.attention.gather import GatheredBlocks
from batchgen.engine.attention.interface import bind_layers
from batchgen.engine.attention.metadata import ForwardContext, StaticDecode


class Layer(torch.nn.Module):
    """An attention module as transformers passes it: it has a layer index, nothing else."""

    def __init__(self, layer_idx: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx


@contextmanager
def running(ctx: ForwardContext, layer_idx: int = 0) -> Iterator[Layer]:
    """A module of layer `layer_idx` bound to a backend whose current step is `ctx` (planned already)."""
    pool = ctx.kv_caches[0][0]
    backend = AttentionBackend(ctx.kv_caches, pool.shape[1], pool.device, GatheredBlocks(pool.shape[1]))
    layer = Layer(layer_idx)
    bind_layers(layer, backend)
    with backend.running(ctx):
        yield layer


class DirectStager:
    """Each tensor straight to its device (the engine stages through its staging.transfers.Transfers)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def stage(self, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.device)


CPU_STAGER = DirectStager(torch.device("cpu"))


def static_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StaticDecode,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The reference of a CUDA-graph decode step's attention (what the triton backend computes from
    cuda/graphs' fixed buffers): q [H, B, D] (one query per row) over the pool -> [B, H, D]."""
    h, b, d = q.shape
    kvh, bs = k_cache.shape[2], k_cache.shape[1]
    index = meta.block_tables.reshape(-1)
    k = k_cache.index_select(0, index).view(b, -1, kvh, d).transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache.index_select(0, index).view(b, -1, kvh, d).transpose(1, 2)
    kv = torch.arange(meta.block_tables.shape[1] * bs, device=q.device)  # [L]
    q_pos = (meta.context_lens - 1)[:, None]  # [B, 1]
    allowed = kv[None] <= q_pos
    if window is not None:
        allowed &= kv[None] > q_pos - window
    mask = allowed[:, None, None, :]  # [B, 1, 1, L]
    qg = q.transpose(0, 1).reshape(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    if softcap is None:
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    else:
        scores = torch.tanh(torch.matmul(qg, k.transpose(-1, -2)) * scale / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32)
        out = torch.matmul(probs.to(q.dtype), v)
    return out.reshape(b, h, d)
