"""The decode K/V source: where a step's decodes read their keys and values from.

Why a seam: gathered blocks (the torch backend) copy each decode's blocks out of the pool per
layer, group the step's decodes by length and hand each group's keys [B, KVH, D, L] and values
[B, KVH, L, D] to the torch math; contiguous rows (the CPU backend) keep a growing per-sequence
copy, saving most of that copy on a memory-bound CPU, which the native kernel attends itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from batchgen.engine.attention.cascade import cascade_len
from batchgen.engine.attention.op import LayerCall

Pool = tuple[torch.Tensor, torch.Tensor]  # one layer's K, V: [num_blocks, block_size, KVH, D]
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a layer's q [H, T, D], key and value [KVH, T, D]


class DecodeRequest(NamedTuple):
    """One decode of this step: the sequence, its position (= tokens already cached) and its blocks."""

    seq_id: int
    position: int
    block_table: Sequence[int]
    max_len: int = 0  # the most tokens the sequence may ever hold (prompt + max_tokens); 0: unknown


@dataclass
class DecodeGroup:
    """Consecutive decodes of a step, attended in one padded call: packed tokens [start, start + num_seqs)."""

    start: int
    num_seqs: int
    context_lens: torch.Tensor  # [num_seqs] tokens in cache after this step, the new one included
    kv_len: int  # L: the padded key length of the group's K/V
    shared_len: int = 0  # > 0: the first shared_len keys are the same blocks in every row (cascade)
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, 1, L]


class DecodeStep(Protocol):
    """One step's decodes as a source planned them; the attention function reads only this."""

    def attend(self, call: LayerCall, pool: Pool, qkv: QKV, out: torch.Tensor, slots: torch.Tensor | None) -> None:
        """Attend every decode of this layer into out's first rows (q [H, T, D], key/value [KVH, T, D]
        of the step, decodes first; out [T, H, D]), its K/V stored in the pool at `slots` when given
        (only where writes_pool; else the caller stored them before)."""

    @property
    def writes_pool(self) -> bool:
        """Whether attend() can store a decode-only step's K/V in the pool itself (the caller then does not)."""


class DecodeKVSource(Protocol):
    """Plans every step's decodes; one per model runner, for its lifetime."""

    def plan(self, decodes: list[DecodeRequest], stage: Stage) -> tuple[list[int], DecodeStep]:
        """(packed order of the decodes as indices into `decodes`, the step). Decodes are packed
        first; what the step reads on the device goes through `stage` (the step's one upload)."""

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget these sequences' state (finished, or preempted: a later decode refills); ids it
        does not hold are ignored. Called from the scheduler's diff (ModelRunner.apply)."""

    def reset(self) -> None:
        """Forget every sequence (the engine aborted them all)."""


Stage = Callable[[torch.Tensor], torch.Tensor]  # host int64 tensor -> its device copy (see transfers)


def make_group(start: int, decodes: Sequence[DecodeRequest], kv_len: int, block_size: int, stage: Stage) -> DecodeGroup:
    """A group of consecutive packed decodes padded to `kv_len` keys; cascade when they share enough blocks."""
    positions = [d.position for d in decodes]
    shared = cascade_len([d.block_table for d in decodes], positions, block_size, kv_len)
    context_lens = torch.tensor(positions) + 1  # [B]
    return DecodeGroup(
        start=start, num_seqs=len(decodes), context_lens=stage(context_lens), kv_len=kv_len, shared_len=shared
    )


def padded_tables(tables: Iterable[Sequence[int]], counts: Sequence[int], width: int) -> torch.Tensor:
    """The first counts[i] block ids of tables[i], padded with block 0 (masks hide it) -> [rows, width] int64.

    Why an array: torch.tensor() over nested lists costs ~0.3 us per element; an array copies at C speed.
    """
    buf = array("q")
    for table, n in zip(tables, counts):
        buf.extend(table[:n])
        buf.extend([0] * (width - n))
    return torch.frombuffer(buf, dtype=torch.int64).view(len(counts), width)


def gather_blocks(cache: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """Blocks `index` of one layer's cache as [rows, KVH, L, D] (a strided view of one gathered copy)."""
    blocks = cache.index_select(0, index)  # [rows * max_blocks, block_size, KVH, D]
    return blocks.view(rows, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)
