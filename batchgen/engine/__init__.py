"""batchgen's own inference engine: `LLM`, `SamplingParams`, `RequestOutput` (vLLM-style names).

`LLM` is imported lazily so that the contracts (params, outputs) stay importable without torch.
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.api.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.engine.api.params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from batchgen.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'batchgen.engine' has no attribute {name!r}")
