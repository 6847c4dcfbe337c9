"""The attention of a decode step replayed from a CUDA graph (cuda/graphs): fixed-size buffers,
no per-step Python."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_GRAPH_BATCH = 512  # the most rows a replayed decode step holds (cuda/graphs; the triton plan's buffers)


@dataclass
class StaticDecode:
    """The decode metadata a captured graph reads, in fixed-size buffers ([B] rows, padded)."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, padding: block 0
    context_lens: torch.Tensor  # [B] int64: tokens in cache after this step, padding: 1


def static_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: StaticDecode,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [H, B, D] (one query per row) over the pool, fixed shapes -> [B, H, D]."""
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
