"""A CPU reference of torch's paged `varlen_attn` contract (torch.nn.attention.varlen, FlashAttention-2).

It checks the argument contract the kernel enforces (int32 metadata, shapes, GQA flag, a window
tuple) and computes what the documentation says the kernel computes: per sequence b, the queries
cu_seq_q[b]:cu_seq_q[b+1] attend over the first seqused_k[b] tokens of the pages block_table[b],
causal aligned bottom-right (the last query sits at the last key), keys within window_size =
(left, right) of each query when left/right >= 0. Swapped in for the kernel, it lets a CPU test
check everything the engine passes to it.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _check_contract(query: torch.Tensor, key: torch.Tensor, meta: dict[str, Any]) -> None:
    for name in ("cu_seq_q", "cu_seq_k", "seqused_k", "block_table"):
        assert meta[name].dtype == torch.int32, f"{name} must be int32, got {meta[name].dtype}"
    n = meta["cu_seq_q"].numel() - 1
    assert meta["block_table"].shape[0] == n == meta["seqused_k"].numel() == meta["cu_seq_k"].numel() - 1
    assert key.dim() == 4 and query.dim() == 3 and query.stride(-1) == 1
    q_lens = meta["cu_seq_q"][1:] - meta["cu_seq_q"][:-1]
    k_lens = meta["cu_seq_k"][1:] - meta["cu_seq_k"][:-1]
    assert torch.equal(k_lens, meta["seqused_k"]), "cu_seq_k and seqused_k disagree"
    assert int(q_lens.max()) == meta["max_q"] and int(meta["seqused_k"].max()) == meta["max_k"]
    assert int(meta["cu_seq_q"][-1]) == query.shape[0]
    assert meta["enable_gqa"] == (query.shape[1] != key.shape[2])
    assert isinstance(meta["window_size"], tuple)


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float,
    window_size: tuple[int, int],
    enable_gqa: bool,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
) -> torch.Tensor:
    """query [Tq, Hq, D], key/value [pages, page_size, Hkv, D] -> [Tq, Hq, D]."""
    meta = dict(locals())
    _check_contract(query, key, meta)
    page, hk, d = key.shape[1], key.shape[2], key.shape[3]
    group = query.shape[1] // hk
    left, right = window_size
    out = torch.empty_like(query)
    for b in range(cu_seq_q.numel() - 1):
        q = query[int(cu_seq_q[b]) : int(cu_seq_q[b + 1])]  # [n, Hq, D]
        total = int(seqused_k[b])
        pages = block_table[b, : math.ceil(total / page)].long()
        k = key[pages].reshape(-1, hk, d)[:total].repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = value[pages].reshape(-1, hk, d)[:total].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, n, L]
        q_pos = torch.arange(total - q.shape[0], total)[:, None]
        k_pos = torch.arange(total)[None]
        allowed = k_pos <= q_pos + max(right, 0)
        if left >= 0:
            allowed &= k_pos >= q_pos - left
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[int(cu_seq_q[b]) : int(cu_seq_q[b + 1])] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
