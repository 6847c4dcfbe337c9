"""The Triton kernels: paged attention over the KV pool, and the store of a step's K/V into it.

The launchers (triton/launch) check the arguments and pick the constexprs. Whether `@triton.jit`
gives a compiled or an interpreted kernel is fixed when triton is first imported (support).

Attention: the grid is (tiles, KV heads); a tile is up to BLOCK_M // GROUP query tokens of one
chunk (triton/plan maps tiles to chunks), and its rows are (token, query head) pairs of one KV
head, so GQA heads read each K/V tile once. Keys come BLOCK_N at a time through the chunk's block
table (pool read in place); causal, sliding window (key > position - window) and soft-capping
before the mask; online softmax and both dots in float32. The store masks out PAD_SLOT tokens.

Images whose tokens attend both ways (Gemma 3): with USE_KEY_END a query token may also see the
keys up to its own `key_end` (one past its image's last position; 0 outside such an image), so
key < max(position + 1, key_end): the torch backend's prefill mask, window included.

Only features present since triton 3.0 (torch 2.11 requires 3.6.0; the tests run 3.9.0): no block
pointers, descriptors, autotuning or libdevice. Why input_precision="ieee": float32's default is
TF32, which would break float32 parity with the torch backend.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr,  # [H, T, D] this step's queries, as the model hands them (any strides)
    k_cache_ptr,  # [pool blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,  # same shape and strides as the keys
    out_ptr,  # [T, H, D]
    query_start_ptr,  # [chunks + 1] int64: packed offset of each chunk's first query
    kv_lens_ptr,  # [chunks] int64: keys each chunk attends over (its cached context + its own tokens)
    block_tables_ptr,  # [chunks, W] int64
    tile_chunk_ptr,  # [tiles] int64: the chunk of each tile
    tile_first_ptr,  # [tiles] int64: the tile's first token, within its chunk
    key_end_ptr,  # [T] int64 (read with USE_KEY_END): one past the keys a query token sees both ways
    scale,
    softcap,
    window,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_KEY_END: tl.constexpr,
    DOT_IN_F32: tl.constexpr,  # set only under triton 3.9's interpreter, for bfloat16 (see the launcher)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    chunk = tl.load(tile_chunk_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(query_start_ptr + chunk)
    q_len = tl.load(query_start_ptr + chunk + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + chunk)
    cached = kv_len - q_len  # tokens of the sequence in the pool before this chunk

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP  # [M] within the chunk
    head = kv_head * GROUP + rows % GROUP  # [M]
    row_ok = (rows < (BLOCK_M // GROUP) * GROUP) & (token < q_len)
    pos = cached + token  # [M] the row's position in its sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    q_off = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, D]
    if DOT_IN_F32:
        q = q.to(tl.float32)

    end = tl.minimum(cached + first + BLOCK_M // GROUP, kv_len)  # one past the tile's last key
    limit = pos + 1  # [M] one past the keys each row sees
    if USE_KEY_END:  # an image's tokens also see its later ones (they are in this chunk)
        key_end = tl.load(key_end_ptr + q_start + token, mask=row_ok, other=0)  # [M]
        limit = tl.maximum(limit, key_end)
        end = tl.minimum(tl.maximum(end, tl.max(key_end, 0)), kv_len)
    start = 0
    if USE_WINDOW:  # the first token's lowest key, down to a multiple of BLOCK_N
        start = tl.maximum(cached + first - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked key tile gives exp(-inf) = 0
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + chunk * stride_bt
    head_off = kv_head * stride_ch
    for key0 in range(start, end, BLOCK_N):
        keys = key0 + cols  # [N]
        key_ok = keys < end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (keys % BLOCK_SIZE) * stride_ct + head_off  # [N]
        k = tl.load(  # [D, N]: keys transposed by their addresses
            k_cache_ptr + kv_off[None, :] + dims[:, None] * stride_cd,
            mask=key_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )
        if DOT_IN_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * scale  # [M, N] float32
        if USE_SOFTCAP:  # cap * tanh(s / cap), from exp(-2|x|) <= 1 (no overflow)
            x = s / softcap
            t = tl.exp(-2.0 * tl.abs(x))
            th = (1.0 - t) / (1.0 + t)
            s = softcap * tl.where(x >= 0, th, -th)
        allowed = (keys[None, :] < limit[:, None]) & row_ok[:, None]
        if USE_WINDOW:
            allowed = allowed & (keys[None, :] > pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(  # [N, D]
            v_cache_ptr + kv_off[:, None] + dims[None, :] * stride_cd,
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        p_v = p.to(v.dtype)  # [M, N] the probabilities in the values' dtype, as torch's math rounds them
        if DOT_IN_F32:
            p_v = p_v.to(tl.float32)
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision="ieee")
        m_i = m_new
    l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past the chunk's tokens attended nothing (and are not stored)
    out = acc / l_i[:, None]
    o_off = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def store_kv_kernel(
    key_ptr,  # [KVH, T, D] this step's keys (any strides)
    value_ptr,  # [KVH, T, D] (any strides)
    k_cache_ptr,  # [pool blocks, BLOCK_SIZE, KVH, D]
    v_cache_ptr,  # same shape and strides as the keys
    slots_ptr,  # [T] int64: block * BLOCK_SIZE + offset; PAD_SLOT (-1): a padded token, not stored
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vh,
    stride_vt,
    stride_vd,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_cd,
    num_tokens,
    num_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_D: tl.constexpr,  # head dim, padded to a power of two
    BLOCK_HD: tl.constexpr,  # (KV head, dim) pairs of a token: a power of two >= heads * BLOCK_D
):
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)  # [T_]
    cols = tl.arange(0, BLOCK_HD)
    heads = (cols // BLOCK_D)[None, :]  # [1, HD]
    dims = (cols % BLOCK_D)[None, :]
    slot = tl.load(slots_ptr + tokens, mask=tokens < num_tokens, other=-1)[:, None]  # [T_, 1]
    mask = (slot >= 0) & (heads < num_heads) & (dims < head_dim)  # [T_, HD]
    safe = tl.maximum(slot, 0)  # why: a padded token's address stays in the pool, though masked
    dst = (safe // BLOCK_SIZE) * stride_cb + (safe % BLOCK_SIZE) * stride_ct + heads * stride_ch + dims * stride_cd
    t = tokens[:, None]
    k = tl.load(key_ptr + heads * stride_kh + t * stride_kt + dims * stride_kd, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + heads * stride_vh + t * stride_vt + dims * stride_vd, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
