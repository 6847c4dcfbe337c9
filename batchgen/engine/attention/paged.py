"""Paged attention registered with transformers' AttentionInterface as "batchgen_paged".

One forward = one packed varlen batch: every scheduled token of every sequence in a [1, T] row.
The model runner describes the step in a ForwardContext (set around the forward); for each layer
this function writes the new K/V into the paged pool at the step's slot mapping, then attends
each sequence's queries over its own blocks. Decodes are packed first and attended in a few
padded calls, one per group of similar context length, over the K/V their source hands out (see
decode_kv; this function does not know which source it reads), with cascade attention where the
source marked a shared prefix; every other chunk attends with a causal mask offset by its cached
context, all with torch SDPA. Where the model runner chose the paged varlen kernel (CUDA, half
precision, 256-token blocks: see attention_path), every chunk goes through that kernel instead,
with no gather; a CUDA-graph decode step reads fixed-size buffers (cuda_graphs). Sliding windows
and logit soft-capping are exact; attention sinks are refused.

The registered function only checks the call and hands the tensors to the custom op
`batchgen::paged_attention` (attention_op), whose body is `_paged_attention_impl` below: the
same code runs eager or under torch.compile, and the compiler never sees the step's metadata.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from batchgen.engine.attention import op as attention_op
from batchgen.engine.attention.cascade import cascade_decode_attention
from batchgen.engine.attention.decode_kv import DecodeGroup, DecodeStep, Pool, gather_blocks
from batchgen.engine.attention.kv_store import store_kv
from batchgen.engine.attention.metadata import ForwardContext, PrefillChunk
from batchgen.engine.attention.op import paged_attention
from batchgen.engine.attention.path import varlen_paged_attention
from batchgen.engine.cuda.graphs import static_decode_attention

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "batchgen_paged"


_CONTEXT: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Make `ctx` visible to the attention function for the duration of one forward.

    Why the count restarts here: the op finds a layer by its call number, and a context can serve
    more than one forward (a CUDA graph's warm-up, then its capture)."""
    global _CONTEXT
    ctx.num_attention_calls = 0
    _CONTEXT = ctx
    try:
        yield
    finally:
        _CONTEXT = None


def _current_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is only usable inside batchgen's model runner "
            "(no forward context is set)"
        )
    return _CONTEXT


def _window_mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """Allowed[..., q, kv] for keys 0..kv_len-1: kv <= q_pos (causal) and q_pos - kv < window.

    The window rule is transformers' sliding overlay (`kv_idx > q_idx - sliding_window`).
    """
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
        if chunk.context_start == 0 and window is None:
            chunk.masks[window] = None
        else:
            total = chunk.context_start + chunk.end - chunk.start
            q_pos = torch.arange(chunk.context_start, total, device=device)  # [n]
            chunk.masks[window] = _window_mask(q_pos, total, window)[None, None]  # [1, 1, n, L]
    return chunk.masks[window]


def _decode_bias(group: DecodeGroup, window: int | None, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The decode mask as an additive bias [B * KVH, 1, L] (0 or -inf), once per group and window."""
    if window not in group.biases:
        mask = _decode_mask(group, window)  # [B, 1, 1, L]
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        group.biases[window] = bias.expand(-1, kv_heads, -1, -1).reshape(-1, 1, group.kv_len)
    return group.biases[window]


def _batched_decode_attention(
    qg: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scaling: float, out: torch.Tensor
) -> None:
    """qg [B * KVH, G, D], keys k_t [B, KVH, D, L] contiguous along L, v [B, KVH, L, D] -> out [B * KVH, G, D].

    Why not SDPA: with keys stored transposed, the scores are one batched product that reads each
    key row contiguously, and the output another. On CPU a decode step's attention went from 5.6
    to 3.5 ms (demo model) and from 26.4 to 21.3 ms (57M) against SDPA over [L, D] rows, reading
    K/V about as fast as a plain sum over the same bytes (benchmarks/RESULTS.md, third pass). The
    softmax runs in float32, as transformers' eager one does. Why `out`: the product writes the
    group's rows of the layer's output in place (a view), instead of a copy per group.
    """
    rows, d = qg.shape[0], qg.shape[2]
    scores = torch.baddbmm(bias, qg, k_t.reshape(rows, d, -1), alpha=scaling)  # [B * KVH, G, L]
    if scores.dtype == torch.float32:
        probs = scores.softmax(-1)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    torch.bmm(probs, v.reshape(rows, -1, d), out=out)


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


def _attend_decodes(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    group: DecodeGroup,
    window: int | None,
    scaling: float,
    softcap: float | None,
    out: torch.Tensor,
) -> None:
    """q [B, H, D], keys k_t [B, KVH, D, L], values [B, KVH, L, D] -> out [B, H, D] (written in place)."""
    b, h, d = q.shape
    kvh = k_t.shape[1]
    # why: a decode's G query heads per KV head share one position, so they can stand in as the
    # query length of a plain attention; K/V are read once per KV head, never repeated (this is
    # ~3x faster on CPU than SDPA's enable_gqa on a padded decode batch)
    if softcap is None and k_t.stride(-1) == 1 and out.is_contiguous():  # keys stored transposed (decode rows)
        bias = _decode_bias(group, window, kvh, q.dtype)
        _batched_decode_attention(q.reshape(b * kvh, h // kvh, d), k_t, v, bias, scaling, out.view(b * kvh, -1, d))
        return
    qg = q.reshape(b, kvh, h // kvh, d)  # [B, KVH, G, D]
    out.copy_(_grouped_attention(qg, k_t, v, _decode_mask(group, window), scaling, softcap).reshape(b, h, d))


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


def _decode_attention(
    step: DecodeStep,
    layer: int,
    pool: Pool,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None,
    slots: torch.Tensor | None = None,
) -> None:
    """The decodes' rows of `out` [T, H, D]; q [H, T, D], key/value [KVH, T, D] (this step's, decodes first).
    `slots`: the step's slot mapping when the source stores the decodes' K/V in the pool itself."""
    if softcap is None and step.attend(layer, pool, q, key, value, out, scaling, window, slots):
        return
    step.update(layer, pool, key, value)
    for i, group in enumerate(step.groups):
        first, n = group.start, group.num_seqs
        k_t, v = step.kv(layer, pool, i)  # keys [B, KVH, D, L], values [B, KVH, L, D]
        qd = q[:, first : first + n].transpose(0, 1)  # [B, H, D] (a contiguous view, as the model lays q out)
        if group.shared_len and window is None and softcap is None:
            out[first : first + n] = cascade_decode_attention(
                qd, k_t, v, group.shared_len, _decode_mask(group, window)[..., group.shared_len :], scaling
            )
        else:
            _attend_decodes(qd, k_t, v, group, window, scaling, softcap, out[first : first + n])


def _torch_paged_attention(
    ctx: ForwardContext,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [H, T, D], key/value [KVH, T, D] -> [T, H, D]."""
    k_cache, v_cache = ctx.kv_caches[layer]
    out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)  # [T, H, D]
    if ctx.decodes is not None:
        pool = ctx.kv_caches[layer]
        _decode_attention(ctx.decodes, layer, pool, q, key, value, out, scaling, window, softcap, slots)
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


def _check_kv_shape(ctx: ForwardContext, layer: int, key: torch.Tensor) -> None:
    k_cache = ctx.kv_caches[layer][0]
    if k_cache.shape[2:] != key.shape[0:1] + key.shape[2:]:
        raise RuntimeError(
            f"layer {layer}: model produced K/V with {key.shape[0]} heads of dim {key.shape[2]} but the KV pool "
            f"was sized for {k_cache.shape[2]} heads of dim {k_cache.shape[3]}"
        )


def _decodes_store_kv(ctx: ForwardContext, softcap: float | None) -> bool:
    """A decode-only step whose decode source stores the K/V itself (the native kernel, with its attention)."""
    plain = ctx.static_decode is None and ctx.flash is None and not ctx.prefills and softcap is None
    return plain and ctx.decodes is not None and ctx.decodes.writes_pool


def _store_kv(ctx: ForwardContext, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """key/value [KVH, T, D] -> pool slots of this step (padded tokens, slot -1, go to the trash block)."""
    k_cache, v_cache = ctx.kv_caches[layer]
    padded = ctx.static_decode is not None or ctx.num_tokens != ctx.slot_mapping.shape[0]
    store_kv(k_cache, v_cache, ctx.slot_mapping, key.transpose(0, 1), value.transpose(0, 1), padded)


def _paged_attention_impl(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The body of the custom op: query [H, T, D], key/value [KVH, T, D] -> [T, H, D] (padded rows zero).

    The layer is this call's number in the forward (see attention_op).
    """
    ctx = _current_context()
    layer = ctx.num_attention_calls
    ctx.num_attention_calls += 1
    if layer >= len(ctx.kv_caches):
        raise RuntimeError(f"attention called more than once per layer ({len(ctx.kv_caches)} layers)")
    _check_kv_shape(ctx, layer, key)
    decodes_store = _decodes_store_kv(ctx, softcap)
    if not decodes_store:
        _store_kv(ctx, layer, key, value)
    if ctx.static_decode is not None:  # a CUDA-graph decode step: fixed shapes, no per-step Python state
        k_cache, v_cache = ctx.kv_caches[layer]
        return static_decode_attention(query, k_cache, v_cache, ctx.static_decode, scale, window, softcap)
    if ctx.flash is not None:
        if softcap is not None:  # why: the runner chose this path from the config; never run it wrong
            raise RuntimeError(f"{ATTN_IMPLEMENTATION}: layer {layer} soft-caps its logits; the varlen kernel cannot")
        k_cache, v_cache = ctx.kv_caches[layer]
        out = varlen_paged_attention(ctx.flash, k_cache, v_cache, query, scale, window)
    else:
        slots = ctx.slot_mapping if decodes_store else None
        out = _torch_paged_attention(ctx, layer, query, key, value, scale, window, softcap, slots)
    if ctx.num_tokens < out.shape[0]:  # why: padding rows stay finite (they are never read, but are computed on)
        out[ctx.num_tokens :] = 0
    return out


attention_op.set_impl(_paged_attention_impl)


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
    args = (query[0], key[0], value[0], float(scale), window, None if softcap is None else float(softcap))
    if query.is_cpu and attention_op.FRONT_READY[0]:  # the C++ front: decode plans, else the Python op
        out = torch.ops.batchgen.attention(*args)
    else:
        # why the op only while compiling: the compiler needs it opaque; eager runs call its body
        # directly (the very same code, without the custom-op dispatch on every layer of every step)
        out = paged_attention(*args) if torch.compiler.is_compiling() else _paged_attention_impl(*args)
    return out.unsqueeze(0), None


# Why no AttentionMaskInterface entry: transformers (5.x) skips mask construction entirely for an
# attention implementation that has no registered mask function (`_preprocess_mask_arguments`
# returns early), so the model never builds a [T, T] mask; our masks come from the context.
AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
