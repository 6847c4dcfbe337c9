"""The job file's LoRA keys (`model.lora`, `input.lora_column`, `engine.max_loras`,
`engine.max_lora_rank`, `engine.max_cpu_loras`) checked against each other and the job's task and
backend, before any work: every misfit is refused at its key, never silently ignored.

Why apart from spec.py: the rules are the adapters' own; the adapters' folders are read and
checked against the model later (job/adapters), once the model's config is at hand.
"""

from __future__ import annotations

from typing import Any

from pydantic_core import InitErrorDetails, PydanticCustomError

# Engine settings a job gives only with adapters (`enable_lora` is no job key: model.lora sets it).
ADAPTER_ENGINE_KEYS = ("max_loras", "max_lora_rank", "max_cpu_loras")
MAX_DEFAULT_LORAS = 8  # engine.max_loras when unset: the job's adapter count, at most this many


def lora_errors(spec: Any) -> list[InitErrorDetails]:
    """What in the job's LoRA keys does not fit, each at its key."""
    errors: list[InitErrorDetails] = []

    def add(loc: tuple[str, ...], message: str) -> None:
        errors.append(InitErrorDetails(type=PydanticCustomError("lora", message), loc=loc, input=None))

    adapters, column = spec.model.lora, spec.input.lora_column
    engine_set = spec.engine.model_fields_set
    if not adapters:
        if column is not None:
            add(("input", "lora_column"), "names a row's adapter in model.lora, and the job sets no model.lora")
        for key in ADAPTER_ENGINE_KEYS:
            if key in engine_set:
                add(("engine", key), "is read only with model.lora (the job's LoRA adapters)")
        return errors
    if spec.task != "generate":
        add(("model", "lora"), f"task {spec.task} runs the base model only: adapters serve task generate")
    if spec.engine.backend != "native":
        add(("model", "lora"), f"adapters need engine.backend native ({spec.engine.backend} serves the base weights)")
    if spec.engine.tensor_parallel_size > 1:
        why = "adapters run on one device (tensor parallelism serves the base model only)"
        add(("engine", "tensor_parallel_size"), why)
    if column is None and spec.input.format != "openai_batch":
        add(("input", "lora_column"), "model.lora sets adapters: name the column that says each row's adapter")
    return errors
