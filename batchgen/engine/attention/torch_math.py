"""The portable attention math over the paged KV pool, in torch ops: what the torch backend runs.

Decodes (packed first) attend in a few padded calls, one per group, over their source's K/V
(cascade where a prefix is shared); other chunks with a causal mask offset by their cached
context. Sliding windows and soft-capping are exact.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchgen.engine.attention.cascade import cascade_decode_attention
from batchgen.engine.attention.decode_kv import DecodeGroup, gather_blocks
from batchgen.engine.attention.metadata import ForwardContext, PrefillChunk
from batchgen.engine.attention.op import LayerCall


def _window_mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """Allowed[..., q, kv] for keys 0..kv_len-1: kv <= q_pos and q_pos - kv < window (transformers' rule)."""
    kv = torch.arange(kv_len, device=q_pos.device)  # [L]
    allowed = kv <= q_pos[..., None]
    if window is not None:
        allowed &= kv > q_pos[..., None] - window
    return allowed


def _decode_mask(group: DecodeGroup, window: int | None) -> torch.Tensor:
    if window not in group.masks:
        # why: causality alone hides the padded tail, since a decode's query is its last token
        q_pos = group.context_lens - 1  # [B]
        mask = _window_mask(q_pos, group.kv_len, window)
        group.masks[window] = mask[:, None, None, :]  # [B, 1, 1, L]
    return group.masks[window]


def _prefill_mask(chunk: PrefillChunk, window: int | None, device: torch.device) -> torch.Tensor | None:
    """None means plain causal over the chunk's own keys; else a [1, 1, n, L] bool mask."""
    if window not in chunk.masks:
        if chunk.context_start == 0 and window is None and not chunk.bidirectional:
            chunk.masks[window] = None
        else:
            total = chunk.context_start + chunk.end - chunk.start
            q_pos = torch.arange(chunk.context_start, total, device=device)  # [n]
            mask = _window_mask(q_pos, total, window)  # [n, L]
            kv = torch.arange(total, device=device)  # [L]
            for first, end in chunk.bidirectional:  # an image's tokens also see its later ones
                inside = (q_pos >= first) & (q_pos < end)  # [n]
                same = inside[:, None] & (kv >= first) & (kv < end)  # [n, L]
                if window is not None:  # transformers: the window still bounds what lies behind
                    same &= kv > q_pos[:, None] - window
                mask |= same
            chunk.masks[window] = mask[None, None]  # [1, 1, n, L]
    return chunk.masks[window]


def _grouped_attention(
    qg: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """qg [B, KVH, M, D] (the query rows of each KV head), keys k_t [B, KVH, D, L], values [B, KVH, L, D],
    mask [B|1, 1, M, L]."""
    if softcap is None:
        return F.scaled_dot_product_attention(qg, k_t.transpose(-1, -2), v, attn_mask=mask, scale=scaling)
    # Soft-capping is not expressible in SDPA: transformers' eager formula (Gemma 2), in float32 softmax.
    scores = torch.matmul(qg, k_t) * scaling  # [B, KVH, M, L]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qg.dtype)
    return torch.matmul(probs, v)  # [B, KVH, M, D]


def _attend_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [1, H, n, D], k/v [1, KVH, L, D], mask [1, 1, n, L] (None: causal, n == L) -> [1, H, n, D]."""
    _, h, n, d = q.shape
    kvh, kv_len = k.shape[1], k.shape[2]
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=h != kvh
        )
    if mask is None:  # causal, bottom-right aligned
        mask = torch.ones(n, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - n)[None, None]
    g = h // kvh
    qg = q.reshape(1, kvh, g * n, d)  # rows ordered (group member, position)
    return _grouped_attention(qg, k.transpose(-1, -2), v, mask.repeat(1, 1, g, 1), scaling, softcap).reshape(1, h, n, d)


def decode_group_attention(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, group: DecodeGroup, call: LayerCall
) -> torch.Tensor:
    """One decode group: q [B, H, D], keys k_t [B, KVH, D, L], values [B, KVH, L, D] (row b: positions
    0..L-1 of its b-th decode) -> [B, H, D]."""
    _, scaling, window, softcap = call
    if group.shared_len and window is None and softcap is None:
        own_mask = _decode_mask(group, window)[..., group.shared_len :]
        return cascade_decode_attention(q, k_t, v, group.shared_len, own_mask, scaling)
    # why: a decode's G query heads per KV head share one position, so they can stand in as the
    # query length of a plain attention; K/V are read once per KV head, never repeated (this is
    # ~3x faster on CPU than SDPA's enable_gqa on a padded decode batch)
    qg = q.reshape(q.shape[0], k_t.shape[1], -1, q.shape[2])  # [B, KVH, G, D]
    return _grouped_attention(qg, k_t, v, _decode_mask(group, window), scaling, softcap).reshape(q.shape)


def torch_paged_attention(
    ctx: ForwardContext,
    call: LayerCall,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [H, T, D], key/value [KVH, T, D] -> [T, H, D]."""
    layer, scaling, window, softcap = call
    k_cache, v_cache = ctx.kv_caches[layer]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)  # [T, H, D]
    if ctx.decodes is not None:  # the decodes' rows (packed first), by their source's step
        ctx.decodes.attend(call, ctx.kv_caches[layer], (q, key, value), out, slots)
    for chunk in ctx.prefills:
        if chunk.context_start == 0:  # why: the chunk's own K/V are the whole context, no gather
            k, v = key[None, :, chunk.start : chunk.end], value[None, :, chunk.start : chunk.end]
        else:
            total = chunk.context_start + chunk.end - chunk.start
            k = gather_blocks(k_cache, chunk.block_table, 1)[:, :, :total]  # [1, KVH, total, D]
            v = gather_blocks(v_cache, chunk.block_table, 1)[:, :, :total]
        qc = q[None, :, chunk.start : chunk.end]  # [1, H, n, D]
        res = _attend_chunk(qc, k, v, _prefill_mask(chunk, window, q.device), scaling, softcap)
        out[chunk.start : chunk.end] = res[0].transpose(0, 1)
    return out
