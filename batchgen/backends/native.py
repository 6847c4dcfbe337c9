"""The `native` backend: batchgen's own engine (paged KV cache, prefix caching, continuous batching)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchgen.backends.base import EnginePrompt, OnOutput
from batchgen.backends.weights import weight_errors_as_model_errors
from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.errors import ModelError
from batchgen.job.adapters import read_adapters
from batchgen.job.spec import JobSpec


class NativeBackend:
    name = "native"

    def __init__(self, spec: JobSpec, tokenizer: Any) -> None:
        from batchgen.engine.api.config import engine_config
        from batchgen.engine.llm import LLM
        from batchgen.engine.platforms import platform_for
        from batchgen.engine.runner.models import resolve_device, resolve_dtype

        settings = spec.engine.engine_settings()
        self.adapters = read_adapters(spec)  # model.lora, read (checked against the model by validate)
        if self.adapters is not None:
            settings.update(self.adapters.engine_settings())
        self._lora_requests = self.adapters.requests() if self.adapters is not None else {}
        try:
            # Why resolved here: the engine is handed the very device and dtype the job record names,
            # and its attention backend is resolved by the engine's own rule for that device.
            device = resolve_device(spec.model.device)
            dtype = resolve_dtype(spec.model.dtype, device, str(spec.model.path))
            attention = platform_for(device).attention_backend(settings["attention_backend"])
            with weight_errors_as_model_errors(spec.model.path):
                path, task = str(spec.model.path), "generate"  # a generate job, whatever the folder holds
                config = engine_config(**settings)
                self.llm = LLM(path, config, tokenizer=tokenizer, device=str(device), dtype=dtype, task=task)
        except (OSError, ValueError) as exc:
            raise ModelError(f"model.path {spec.model.path}: {exc}") from exc
        dtype_name = str(dtype).removeprefix("torch.")
        self.runtime = {"device": device.type, "dtype": dtype_name, "attention_backend": attention}
        self.max_model_len = self.llm.max_model_len

    def resolved(self) -> dict[str, str]:
        """The device, dtype and attention backend, and whatever else the engine reports it
        resolved (an `LLM.resolved()`, should it gain one: recorded with no change here)."""
        engine = getattr(self.llm, "resolved", None)
        return {**self.runtime, **(engine() if callable(engine) else {})}

    def generate(
        self,
        prompts: Sequence[EnginePrompt],
        params: list[SamplingParams],
        on_output: OnOutput | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        if adapters is None or not any(adapters):
            return self.llm.generate(list(prompts), params, on_output=on_output)
        requests = [None if a is None else self._lora_requests[a] for a in adapters]
        return self.llm.generate(list(prompts), params, on_output=on_output, lora_request=requests)

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.llm.stats)
