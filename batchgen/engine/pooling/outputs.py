"""PoolingParams: what a pooling call takes (vLLM's shape), and RowResult: what it gives back per
input; the outputs users see are vLLM's shapes, made in batchgen/vllm_compat/pooling.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # why: a type is all RowResult needs; PoolingParams stays importable without torch
    import torch


@dataclass(frozen=True)
class PoolingParams:
    """Per-call pooling options: `dimensions` keeps the first D values of each embedding
    (Matryoshka models), `normalize` overrides the model's normalization (None: the model's)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be null or an integer >= 1, got {self.dimensions!r}")


@dataclass
class RowResult:
    """One input's result: embedding [D], probabilities [C] or a score [] (None: `error` says why)."""

    values: torch.Tensor | None
    cached_tokens: int = 0
    error: str | None = None
