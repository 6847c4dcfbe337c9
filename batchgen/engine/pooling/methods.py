"""LLM's pooling methods (`embed`, `classify`, `score`, vLLM's signatures), kept out of llm.py:
LLM inherits them and provides `pooling_model()`, `tokenizer` and `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchgen.engine.api.prompts import PromptInput
from batchgen.engine.pooling import api as pooling_api
from batchgen.engine.pooling.model import PoolingModel
from batchgen.engine.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingParams,
    ScoringRequestOutput,
)


class PoolingMethods:
    tokenizer: Any
    max_model_len: int

    def pooling_model(self) -> PoolingModel:
        raise NotImplementedError

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): `.outputs.embedding`.
        `truncate_prompt_tokens=k` keeps each prompt's last k tokens (vLLM's left truncation)."""
        pooling_api.refuse_lora(lora_request)
        model, k = self.pooling_model(), truncate_prompt_tokens
        return pooling_api.embed(model, self.tokenizer, self.max_model_len, prompts, pooling_params, k)

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's `LLM.classify`): `.outputs.probs` (and `.label`)."""
        pooling_api.refuse_lora(lora_request)
        model, k = self.pooling_model(), truncate_prompt_tokens
        return pooling_api.classify(model, self.tokenizer, self.max_model_len, prompts, k)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
    ) -> list[ScoringRequestOutput]:
        """A score per (data_1, data_2) pair, 1:N, N:1 or N:N (vLLM's `LLM.score`): a cross-encoder's
        sigmoid, or the cosine of two embeddings for an embedding model."""
        pooling_api.refuse_lora(lora_request)
        model, k = self.pooling_model(), truncate_prompt_tokens
        return pooling_api.score(model, self.tokenizer, self.max_model_len, data_1, data_2, k)
