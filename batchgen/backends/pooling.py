"""The `pooling` backend: a pooling job's model (task embed, classify or score) behind the same
load-once-per-process step as generation (run/part_work.load_engine). It builds batchgen's LLM
with the job's task, so decoder embeddings run through the engine and the rest through
transformers (engine/pooling/model), and hands each part's encoded rows to it.
"""

from __future__ import annotations

from typing import Any

from batchgen.backends.weights import weight_errors_as_model_errors
from batchgen.engine.pooling.config import PoolingParams
from batchgen.engine.pooling.hf_runner import Encoded
from batchgen.engine.pooling.model import PoolingModel, RowResult
from batchgen.errors import ModelError
from batchgen.job.spec import JobSpec


class PoolingBackend:
    name = "pooling"

    def __init__(self, spec: JobSpec, tokenizer: Any) -> None:
        from batchgen.engine.api.config import engine_config
        from batchgen.engine.llm import LLM
        from batchgen.engine.pooling.config import PoolingConfigError
        from batchgen.engine.runner.models import resolve_device, resolve_dtype

        pooling = spec.pooling
        settings = spec.engine.engine_settings()
        try:
            device = resolve_device(spec.model.device)
            dtype = resolve_dtype(spec.model.dtype, device, str(spec.model.path))
            config = pooling.pooler_config() if pooling is not None else {}
            with weight_errors_as_model_errors(spec.model.path):
                self.llm = LLM(
                    str(spec.model.path), engine_config(**settings), tokenizer=tokenizer, device=str(device),
                    dtype=dtype, task=spec.task, pooler_config=config,
                )  # fmt: skip
            self.model: PoolingModel = self.llm.pooling_model()
        except (OSError, ValueError, PoolingConfigError) as exc:
            raise ModelError(f"model.path {spec.model.path}: {exc}") from exc
        if spec.task == "score" and pooling is not None and pooling.score == "row" and not self.model.classifier:
            raise ModelError(
                f"model.path {spec.model.path}: pooling.score row needs a sequence-classification head "
                "(a reward model or cross-encoder); an embedding model scores pairs only (pooling.score: pair)"
            )
        if spec.task == "embed" and pooling is not None and pooling.dimensions is not None:
            hidden = int(self.llm.hf_config.get_text_config().hidden_size)  # loaded: no re-read
            if pooling.dimensions > hidden:
                raise ModelError(f"pooling.dimensions {pooling.dimensions} exceeds the model's hidden size {hidden}")
        runner = "engine" if self.model.engine is not None else "transformers"
        self.runtime = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "pooling_runner": runner}
        self.max_model_len = self.llm.max_model_len
        self.params = PoolingParams(dimensions=pooling.dimensions if pooling is not None else None)

    def resolved(self) -> dict[str, str]:
        return dict(self.runtime)

    def run(self, task: str, inputs: list[Encoded], pairs: list[tuple[Encoded, Encoded]] | None) -> list[RowResult]:
        """One result per input, in order: embeddings, class probabilities or scores."""
        if task == "embed":
            return self.model.embed(inputs, self.params)
        if task == "classify":
            return self.model.classify(inputs)
        return self.model.score(inputs, pairs)
