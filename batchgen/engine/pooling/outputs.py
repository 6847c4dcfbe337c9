"""PoolingParams: what a pooling call takes (vLLM's shape); the outputs are vLLM's shapes too and live
with the pooling calls in batchgen/vllm_compat/pooling.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """Per-call pooling options: `dimensions` keeps the first D values of each embedding
    (Matryoshka models), `normalize` overrides the model's normalization (None: the model's)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be null or an integer >= 1, got {self.dimensions!r}")
