"""Gathered blocks: the decode K/V source that copies each decode's blocks out of the paged pool per layer.

Why: no memory beyond the pool, no state across steps, and a cheap copy on a GPU. Decodes are
packed shortest first in a few groups of similar length, so short ones are not padded to the longest.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

import torch

from batchgen.engine.attention.decode_kv import (
    QKV,
    DecodeGroup,
    DecodeRequest,
    Pool,
    Stage,
    gather_blocks,
    make_group,
    padded_tables,
)
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.attention.torch_math import decode_group_attention

# Decode grouping (see split_decodes): measured on CPU, 4 groups over 64 mixed-length decodes
# halve the gather + attention time of one padded group; more groups gain nothing.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8
DECODE_MERGE_RATIO = 1.25


def split_decodes(blocks: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive decodes' sizes (blocks or tokens) -> groups (start, end, largest size).

    Equal-count groups of at least MIN_DECODE_GROUP rows, at most MAX_DECODE_GROUPS; a group joins
    the previous one when that pads it by at most DECODE_MERGE_RATIO (each costs calls per layer).
    """
    m = len(blocks)
    if m == 0:
        return []
    count = max(1, min(MAX_DECODE_GROUPS, m // MIN_DECODE_GROUP))
    bounds = [round(i * m / count) for i in range(count + 1)]
    groups: list[tuple[int, int, int]] = []
    for a, b in pairwise(bounds):
        longest = max(blocks[a:b])
        if groups and longest <= DECODE_MERGE_RATIO * groups[-1][2]:
            groups[-1] = (groups[-1][0], b, max(longest, groups[-1][2]))
        else:
            groups.append((a, b, longest))
    return groups


class GatherStep:
    """One step's decode groups, each with the flat block ids its rows gather (a DecodeStep)."""

    writes_pool = False

    def __init__(self, groups: list[DecodeGroup], indices: list[torch.Tensor]) -> None:
        self.groups = groups
        self._indices = indices  # per group [num_seqs * blocks] block ids

    def attend(self, call: LayerCall, pool: Pool, qkv: QKV, out: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Group by group: its rows' blocks gathered from the pool, attended in torch (torch_math)."""
        for group, index in zip(self.groups, self._indices):
            first, n = group.start, group.num_seqs
            k_t = gather_blocks(pool[0], index, n).transpose(-1, -2)  # [B, KVH, D, L], a view
            q = qkv[0][:, first : first + n].transpose(0, 1)  # [B, H, D] (a contiguous view, as the model lays q out)
            out[first : first + n] = decode_group_attention(q, k_t, gather_blocks(pool[1], index, n), group, call)


class GatheredBlocks:
    """The stateless decode K/V source: every step gathers from the pool."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def plan(self, decodes: list[DecodeRequest], stage: Stage) -> tuple[list[int], GatherStep]:
        # why stable: ties keep batch order
        order = sorted(range(len(decodes)), key=lambda i: decodes[i].position)
        packed = [decodes[i] for i in order]
        needed = [d.position // self.block_size + 1 for d in packed]  # blocks holding positions 0..position
        groups, indices = [], []
        for a, b, mb in split_decodes(needed):
            groups.append(make_group(a, packed[a:b], mb * self.block_size, self.block_size, stage))
            tables = padded_tables([d.block_table for d in packed[a:b]], needed[a:b], mb)  # [B, mb]
            indices.append(stage(tables.flatten()))  # [B * mb]
        return order, GatherStep(groups, indices)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Nothing is kept across steps."""

    def reset(self) -> None:
        """Nothing is kept across steps."""
