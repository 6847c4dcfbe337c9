"""Step metadata: what one forward needs to know about the packed batch, built by the model runner.

The model runner builds a ForwardContext once per step; the attention function reads it for
every layer. Nothing here computes: these are the shapes and indices of one step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.decode_rows import ClassStep, RowsView


@dataclass
class DecodeGroup:
    """Consecutive one-token chunks of a step, padded to one length: packed tokens [start, start + num_seqs).

    A step's decodes (packed first) are split into a few groups of similar context length, so a
    short sequence is not padded to the longest one's blocks (gather and attention cost the padding).
    """

    start: int
    num_seqs: int
    gather_index: torch.Tensor | None  # [num_seqs * blocks] block ids (padding: block 0), or
    rows: ClassStep | None  # decode rows 0..num_seqs-1 of one length class hold the K/V
    context_lens: torch.Tensor  # [num_seqs] tokens in cache after this step, the new one included
    kv_len: int  # padded key length L: blocks * block_size when gathered, the longest context in rows
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> [B, 1, 1, L]
    shared_len: int = 0  # > 0: the first shared_len keys are the same blocks in every row (cascade)


@dataclass
class PrefillChunk:
    """One multi-token chunk: packed tokens [start, end), positions context_start + (0..n-1)."""

    start: int
    end: int
    context_start: int  # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks covering context_start + n tokens]
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> [1, 1, n, L]


@dataclass
class FlashMetadata:
    """flash-attn varlen metadata for the whole packed batch (CUDA only)."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32


@dataclass
class ForwardContext:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V: [num_blocks, block_size, kvh, d]
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token
    decodes: list[DecodeGroup]
    prefills: list[PrefillChunk]
    flash: FlashMetadata | None = None
    rows: RowsView | None = None  # CPU: decodes read K/V from contiguous rows, not gathered blocks
    num_attention_calls: int = 0  # checked by the runner: every layer must come through us
