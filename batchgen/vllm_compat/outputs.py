"""`vllm.outputs`: generation's RequestOutput and the pooling outputs, from one module as vLLM has them."""

from __future__ import annotations

from batchgen.engine.api.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.vllm_compat.pooling import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
