"""Launching the Triton kernels (triton/kernels): argument checks, strides, grids and constexprs.
A launch reads only plan tensors and shapes, so inside a CUDA graph it replays as captured.
"""

from __future__ import annotations

import torch

from batchgen.engine.attention.op import LayerCall
from batchgen.engine.triton.kernels import paged_attention_kernel, store_kv_kernel
from batchgen.engine.triton.plan import KernelPlan

BLOCK_N = 32  # keys per inner step: two 16-token pool blocks
MIN_DIM = 16  # tl.dot's smallest inner size: the head dim is padded to a power of two >= 16
# the store: up to 16 tokens a program, at most 4,096 elements (e.g. 4 tokens of 8 KV heads x 128)
MAX_STORE_TOKENS = 16
STORE_ELEMENTS = 4096


def interpreted(kernel: object) -> bool:
    """Whether `kernel` runs under Triton's interpreter (whose dot multiplies bfloat16 as raw 16-bit
    patterns, so there the kernel upcasts bfloat16 operands: the same products, exactly)."""
    return type(kernel).__name__ == "InterpretedFunction"


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(n - 1, 0).bit_length())


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """key/value [KVH, T, D] into the pool [blocks, block_size, KVH, D] at slots [T] (PAD_SLOT: skipped)."""
    kvh, tokens, d = key.shape
    if slots.shape[0] != tokens or value.shape != key.shape or k_cache.stride() != v_cache.stride():
        raise RuntimeError(
            f"store_kv: {tokens} tokens of K {tuple(key.shape)} / V {tuple(value.shape)} for {slots.shape[0]} slots"
        )
    block_d = _pow2(d)
    cols = _pow2(kvh * block_d)
    per_program = max(1, min(MAX_STORE_TOKENS, STORE_ELEMENTS // cols))  # a power of two: cols is one
    store_kv_kernel[(-(-tokens // per_program),)](
        key,
        value,
        k_cache,
        v_cache,
        slots,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        tokens,
        kvh,
        d,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_T=per_program,
        BLOCK_D=block_d,
        BLOCK_HD=cols,
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: KernelPlan,
    call: LayerCall,
    key_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [H, T, D] (packed, the plan's chunk order) over the pool -> [T, H, D]. `key_end` [T]:
    images attending both ways (plan.image_key_ends), None: none in the step.

    Rows of tokens no tile covers (padding past the step's tokens) are left unwritten."""
    heads, tokens, d = query.shape
    kvh, (_, scale, window, softcap) = k_cache.shape[2], call
    if heads != kvh * plan.group or query.dtype != k_cache.dtype or k_cache.stride() != v_cache.stride():
        raise RuntimeError(
            f"paged_attention: {heads} query heads ({query.dtype}) over {kvh} KV heads ({k_cache.dtype}), "
            f"planned for {plan.group} query heads per KV head"
        )
    out = query.new_empty(tokens, heads, d)  # [T, H, D]
    tiles = plan.tile_chunk.shape[0]
    if tiles == 0:
        return out
    paged_attention_kernel[(tiles, kvh)](
        query,
        k_cache,
        v_cache,
        out,
        plan.query_start,
        plan.kv_lens,
        plan.block_tables,
        plan.tile_chunk,
        plan.tile_first,
        plan.query_start if key_end is None else key_end,  # (not read without USE_KEY_END)
        scale,
        0.0 if softcap is None else softcap,
        0 if window is None else window,
        *query.stride(),
        *k_cache.stride(),
        *out.stride(),
        plan.block_tables.stride(0),
        d,
        BLOCK_SIZE=k_cache.shape[1],
        GROUP=plan.group,
        BLOCK_M=plan.rows,
        BLOCK_N=BLOCK_N,
        BLOCK_D=_pow2(d, MIN_DIM),
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_KEY_END=key_end is not None,
        DOT_IN_F32=query.dtype == torch.bfloat16 and interpreted(paged_attention_kernel),
    )
    return out
