"""Shared-prefix ("cascade") decode attention: a prefix every sequence of a decode group holds in the
same KV blocks is read once for the group, not once per sequence.

Why: CPU decode attention is memory-bound and a few-shot preamble would be read again per
sequence. Softmax splits exactly over a partition of the keys (parts merged by rescaling to the
common max). Plain causal attention only (no window, no soft-cap); decided from block tables alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A group is worth splitting when its shared prefix is at least this share of its padded keys
# and it has at least this many sequences (below that the extra kernels cost more than the reads).
CASCADE_MIN_SHARE = 0.5
CASCADE_MIN_SEQS = 4


def shared_prefix_len(tables: Sequence[Sequence[int]], cached: Sequence[int], block_size: int) -> int:
    """Tokens from the start every sequence holds in the very same, fully cached blocks (plain
    Python on purpose: tuple slices compare at C speed)."""
    full = min(cached) // block_size
    if full == 0 or len(tables) < 2:
        return 0
    first = tuple(tables[0][:full])
    for table in tables[1:]:
        if tuple(table[:full]) != first:
            full = next(j for j, (a, b) in enumerate(zip(table, first)) if a != b)
            if full == 0:
                return 0
            first = first[:full]
    return full * block_size


def cascade_len(tables: Sequence[Sequence[int]], cached: Sequence[int], block_size: int, kv_len: int) -> int:
    """The shared prefix a decode group of these block tables should read once (0: not worth it)."""
    # why first: the cheap bounds rule most groups out before any block is compared
    if len(tables) < CASCADE_MIN_SEQS or (min(cached) // block_size) * block_size < CASCADE_MIN_SHARE * kv_len:
        return 0
    shared = shared_prefix_len(tables, cached, block_size)
    return shared if shared >= CASCADE_MIN_SHARE * kv_len else 0


def _part(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [..., M, L] (-inf where masked), v [..., L, D] -> (exp-weighted sum of v, max, sum), unnormalised."""
    top = scores.amax(dim=-1, keepdim=True)  # [..., M, 1]
    weights = torch.exp(scores - top)
    return torch.matmul(weights, v), top, weights.sum(dim=-1, keepdim=True)


def cascade_decode_attention(
    q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, shared: int, own_mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [B, H, D]; keys k_t [B, KVH, D, L] and values v [B, KVH, L, D] whose first `shared`
    positions are the same K/V in every row; own_mask [B, 1, 1, L - shared] (True: attend) -> [B, H, D].

    In float32: half-precision exp-sums would lose what SDPA keeps.
    """
    b, h, d = q.shape
    kvh = k_t.shape[1]
    g = h // kvh
    qg = q.float().reshape(b, kvh, g, d)  # [B, KVH, G, D]
    # shared part: all B*G queries of a KV head against one copy of the prefix
    q_all = qg.transpose(0, 1).reshape(kvh, b * g, d)  # [KVH, B*G, D]
    scores = torch.matmul(q_all, k_t[0, ..., :shared].float()) * scaling  # [KVH, B*G, P]
    parts = [
        t.reshape(kvh, b, g, -1).transpose(0, 1)  # [B, KVH, G, .]
        for t in _part(scores, v[0, :, :shared].float())
    ]
    # own part: each row's keys after the prefix
    scores = torch.matmul(qg, k_t[..., shared:].float()) * scaling  # [B, KVH, G, L - P]
    own = _part(scores.masked_fill(~own_mask, float("-inf")), v[:, :, shared:].float())
    top = torch.maximum(parts[1], own[1])  # [B, KVH, G, 1]
    scale_shared, scale_own = torch.exp(parts[1] - top), torch.exp(own[1] - top)
    out = (parts[0] * scale_shared + own[0] * scale_own) / (parts[2] * scale_shared + own[2] * scale_own)
    return out.reshape(b, h, d).to(q.dtype)  # [B, H, D]
