"""Step metadata: the shapes and indices of one packed step (a ForwardContext, built once per step,
read by every layer); the decodes (packed first) are described by their K/V source's step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.attention.decode_kv import DecodeStep

MAX_GRAPH_BATCH = 512  # the most rows a replayed decode step holds (cuda/graphs; the triton plan's buffers)


@dataclass
class PrefillChunk:
    """One chunk that is not a decode: packed tokens [start, end), positions context_start + (0..n-1)."""

    start: int
    end: int
    context_start: int  # tokens of this sequence already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks] covering context_start + n tokens (a padded staged row on varlen)
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)  # window -> [1, 1, n, L]
    # positions [first, end) of images inside this chunk whose tokens attend both ways (Gemma 3)
    bidirectional: tuple[tuple[int, int], ...] = ()


@dataclass
class FlashMetadata:
    """The paged varlen kernel's metadata for the whole packed batch (attention_path, CUDA only)."""

    cu_seqlens_q: torch.Tensor  # [num_seqs + 1] int64 (staged; cast to int32 where used, after the upload)
    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int64, over each chunk's whole context
    max_seqlen_q: int
    max_seqlen_k: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64
    seqused_k: torch.Tensor  # [num_seqs] int64: keys each chunk attends over (context + its own tokens)


@dataclass
class StaticDecode:
    """The decode metadata a captured CUDA graph reads (cuda/graphs), in fixed-size buffers ([B] rows, padded)."""

    block_tables: torch.Tensor  # [B, max_blocks] int64, padding: block 0
    context_lens: torch.Tensor  # [B] int64: tokens in cache after this step, padding: 1


@dataclass
class ForwardContext:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V: [num_blocks, block_size, kvh, d]
    slot_mapping: torch.Tensor  # [T] flat slot (block * block_size + offset) of each new token, -1: padding
    decodes: DecodeStep | None  # the decodes (packed first) as their source planned them; None: no decodes
    prefills: list[PrefillChunk]
    flash: FlashMetadata | None = None  # set: the varlen kernel reads the pool for every chunk, decodes included
    num_tokens: int = 0  # real tokens of the step; the forward may run more (padding, slot -1)
    static_decode: StaticDecode | None = None  # set: a CUDA-graph decode step (cuda_graphs), fixed shapes
    num_attention_calls: int = 0  # checked by the runner: every layer must come through us
