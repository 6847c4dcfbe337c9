"""What the pooling API returns and takes, shaped like vLLM's; batchgen adds `num_cached_tokens`
and `error` (then `outputs` is None), as its RequestOutput does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar


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
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]
    label: str | None = None  # config.id2label of the most probable class (batchgen's addition)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


T = TypeVar("T")


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T | None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    error: str | None = None


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]
