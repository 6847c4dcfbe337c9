"""What vLLM clients read back from an LLM, in vLLM's spelling: `llm.llm_engine.model_config`.

Clients size their requests from it (lm-evaluation-harness reads `model_config.max_model_len`):
read-only views of what the LLM resolved; the engine itself is `LLM.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from batchgen.engine.api.params import MAX_LOGPROBS


@dataclass(frozen=True)
class ModelConfig:
    """vLLM's ModelConfig fields that describe the loaded model (read-only)."""

    model: str
    tokenizer: str
    max_model_len: int
    dtype: torch.dtype
    seed: int | None
    hf_config: PretrainedConfig
    max_logprobs: int = MAX_LOGPROBS
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    revision: str | None = None

    @property
    def served_model_name(self) -> str:
        return self.model

    @property
    def hf_text_config(self) -> PretrainedConfig:
        return self.hf_config.get_text_config()

    def get_vocab_size(self) -> int:
        return int(self.hf_text_config.vocab_size)

    def get_hidden_size(self) -> int:
        return int(self.hf_text_config.hidden_size)


class LLMEngineView:
    """`llm.llm_engine`: the model config and the tokenizer, as vLLM's LLMEngine exposes them."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self._tokenizer = tokenizer

    def get_model_config(self) -> ModelConfig:
        return self.model_config

    def get_tokenizer(self) -> Any:
        return self._tokenizer
