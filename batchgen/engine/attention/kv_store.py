"""Writing a step's new K/V into the paged pool, with padded tokens (slot -1) sent to a trash block.

Why a trash block: padded tokens (compile buckets, CUDA graphs) belong to no sequence; masking
them out needs their count on the host (a sync), so the pool has one extra, never-read block and
every slot -1 is redirected there: the same kernels whatever the padding.
"""

from __future__ import annotations

import torch

PAD_SLOT = -1


def pool_blocks(num_kv_blocks: int) -> int:
    """Blocks to allocate for a pool whose block manager hands out `num_kv_blocks`: one more, the trash block."""
    return num_kv_blocks + 1


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padded: bool = True,
) -> None:
    """k/v_cache [blocks + 1, block_size, KVH, D]; slots [T] (PAD_SLOT: skip); key/value [T, KVH, D].
    `padded` False: no slot is PAD_SLOT, so the remap is skipped."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_flat, v_flat = k_cache.view(-1, kvh, d), v_cache.view(-1, kvh, d)
    trash = k_flat.shape[0] - 1  # the last slot of the trash block
    index = torch.where(slots < 0, trash, slots) if padded else slots
    k_flat.index_copy_(0, index, key.to(k_cache.dtype))
    v_flat.index_copy_(0, index, value.to(v_cache.dtype))
