"""The job file's `task` and `pooling` section: what a pooling job (embed, classify, score)
computes per row, and the checks that refuse, before any work, a job whose keys do not fit its
task (sampling keys on a pooling task, a pooling section on a generate job, a score job that
does not say whether it scores rows or pairs).

Why apart from spec.py: the rules are the pooling tasks' own; spec.py only calls `check_task`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from batchgen.job.sections import _Strict

Task = Literal["generate", "embed", "classify", "score"]


class PoolingSection(_Strict):
    pooling_type: Literal["last", "mean", "cls"] | None = None  # null: the model folder's, else last / cls
    normalize: bool | None = None  # null: the folder's Normalize module (sentence-transformers), else true
    dimensions: int | None = Field(default=None, ge=1)  # Matryoshka: keep the first D values, then normalize
    embedding_dtype: Literal["float32", "float16"] = "float32"  # the `embedding` column's value type
    score: Literal["row", "pair"] | None = None  # task score: one score per row, or per (prompt, document) pair
    document_column: str | None = None  # score pair: the second text of each pair

    @model_validator(mode="after")
    def _pair(self) -> PoolingSection:
        if self.score == "pair" and self.document_column is None:
            raise ValueError("pooling.score pair needs pooling.document_column (the second text of each pair)")
        if self.score != "pair" and self.document_column is not None:
            raise ValueError("pooling.document_column is read only with pooling.score: pair")
        return self

    def pooler_config(self) -> dict[str, Any]:
        """The LLM's pooler_config: only what the job sets (the rest comes from the model folder)."""
        config: dict[str, Any] = {}
        if self.pooling_type is not None:
            config["pooling_type"] = self.pooling_type
        if self.normalize is not None:
            config["normalize"] = self.normalize
        return config


def task_errors(task: str, pooling: PoolingSection | None, spec: Any) -> list[InitErrorDetails]:
    """What in the job does not fit its task, each at its key."""
    errors: list[InitErrorDetails] = []

    def add(loc: tuple[str, ...], message: str) -> None:
        errors.append(InitErrorDetails(type=PydanticCustomError("task", message), loc=loc, input=None))

    if task == "generate":
        if pooling is not None:
            add(("pooling",), "a pooling section is read only with task embed, classify or score")
        return errors
    for name in sorted(spec.sampling.model_fields_set):
        add(("sampling", name), f"task {task} generates nothing: remove the sampling section's keys")
    for name in spec.input.sampling_columns if spec.input.format != "openai_batch" else ():  # (set by the format)
        add(("input", "sampling_columns", name), f"task {task} generates nothing: no per-row sampling columns")
    if spec.engine.backend != "native":
        add(("engine", "backend"), f"task {task} picks its own runner (the engine, or transformers for encoders)")
    if task == "score" and (pooling is None or pooling.score is None):
        add(
            ("pooling", "score"),
            "task score needs pooling.score: row (a reward model / classifier scores each row) "
            "or pair (with pooling.document_column)",
        )
    if task == "score" and pooling is not None and pooling.score == "pair" and spec.input.messages_column is not None:
        add(("input", "messages_column"), "pooling.score pair pairs input.prompt_column's text with the document")
    if task != "score" and pooling is not None and pooling.score is not None:
        add(("pooling", "score"), "pooling.score is read only with task score")
    if task != "embed" and pooling is not None and pooling.dimensions is not None:
        add(("pooling", "dimensions"), "pooling.dimensions is read only with task embed")
    return errors
