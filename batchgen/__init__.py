"""batchgen: offline batch inference over Parquet prompt datasets."""

from __future__ import annotations

from typing import Any

from batchgen.engine.api.lora_request import LoRARequest
from batchgen.engine.api.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.engine.api.params import SamplingParams, StructuredOutputsParams
from batchgen.engine.pooling.config import PoolingParams

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # why lazy: `LLM` pulls in torch and transformers; the CLI's --help and job validation should not
    if name == "LLM":  # vLLM's keywords over the engine's LLM (batchgen.engine.llm takes an EngineConfig)
        from batchgen.vllm_compat.llm import LLM

        return LLM
    raise AttributeError(f"module 'batchgen' has no attribute {name!r}")
