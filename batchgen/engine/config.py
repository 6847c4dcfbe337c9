"""EngineConfig: the engine's knobs, validated once at LLM construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # tokens (prefill chunks + decodes) in one step
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # where decodes read K/V (see decode_kv): "auto" = contiguous rows on CPU, gathered blocks elsewhere
    decode_kv: Literal["auto", "gather", "rows"] = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an integer >= 1, got {value!r}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 1):
            raise ValueError(f"EngineConfig.num_kv_blocks must be an integer >= 1, got {self.num_kv_blocks!r}")
        if self.decode_kv not in ("auto", "gather", "rows"):
            raise ValueError(f"EngineConfig.decode_kv must be 'auto', 'gather' or 'rows', got {self.decode_kv!r}")
