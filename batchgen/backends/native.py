"""The `native` backend: batchgen's own engine (paged KV cache, prefix caching, continuous batching)."""

from __future__ import annotations

from typing import Any

from batchgen.backends.base import OnOutput
from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.errors import ModelError
from batchgen.job import JobSpec
from batchgen.weights import weight_errors_as_model_errors


class NativeBackend:
    name = "native"

    def __init__(self, spec: JobSpec, tokenizer: Any) -> None:
        from batchgen.engine.llm import LLM

        try:
            with weight_errors_as_model_errors(spec.model.path):
                self.llm = LLM(
                    str(spec.model.path),
                    tokenizer=tokenizer,
                    device=spec.model.device,
                    dtype=spec.model.dtype,
                    **spec.engine.engine_settings(),
                )
        except (OSError, ValueError) as exc:
            raise ModelError(f"model.path {spec.model.path}: {exc}") from exc
        self.max_model_len = self.llm.max_model_len

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], on_output: OnOutput | None = None
    ) -> list[RequestOutput]:
        return self.llm.generate(prompts, params, on_output=on_output)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.llm.stats)
