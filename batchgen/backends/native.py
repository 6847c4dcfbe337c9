"""The `native` backend: batchgen's own engine (paged KV cache, prefix caching, continuous batching)."""

from __future__ import annotations

from typing import Any

from batchgen.backends.base import OnOutput
from batchgen.engine.outputs import RequestOutput
from batchgen.engine.params import SamplingParams
from batchgen.errors import ModelError
from batchgen.job import JobSpec


class NativeBackend:
    name = "native"

    def __init__(self, spec: JobSpec, tokenizer: Any) -> None:
        from batchgen.engine.llm import LLM

        e = spec.engine
        memory = e.kv_cache_memory_mb * (1 << 20) if e.kv_cache_memory_mb else None
        try:
            self.llm = LLM(
                str(spec.model.path),
                device=spec.model.device,
                dtype=spec.model.dtype,
                block_size=e.block_size,
                max_num_seqs=e.max_num_seqs,
                max_num_batched_tokens=e.max_num_batched_tokens,
                num_kv_blocks=e.num_kv_blocks,
                kv_cache_memory_bytes=memory,
                enable_prefix_caching=e.enable_prefix_caching,
                max_model_len=e.max_model_len,
                tokenizer=tokenizer,
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
