"""Which LoRA adapter each row runs: the value of `input.lora_column` (an OpenAI batch file: the
request's `body.model`), read against the job's `model.lora`.

Why one module: row preparation (a row naming an unknown adapter is an error row) and the prefix
plan (rows keyed by their adapter first, so each adapter's rows run together) read it alike.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.job.spec import JobSpec

UNKNOWN_ADAPTER = "unknown_adapter"  # the error_code of a row naming an adapter the job does not have
OPENAI_MODEL_COLUMN = "model"  # an OpenAI batch row's body.model (inputs/openai_requests)


def adapter_column(spec: JobSpec) -> str | None:
    """The input column naming each row's adapter; None: every row runs the base model."""
    if not spec.model.lora:
        return None
    if spec.input.format == "openai_batch":
        return OPENAI_MODEL_COLUMN
    return spec.input.lora_column


def row_adapters(spec: JobSpec, table: pa.Table) -> list[tuple[str | None, str | None]]:
    """Per row: (the adapter it names, None for the base model; why it cannot run, None when it can).

    Null or empty names the base model. A name not in model.lora is a problem; in an OpenAI batch
    file it is not: `body.model` naming anything else (the base model's name, say) runs the base."""
    column = adapter_column(spec)
    if column is None:
        return [(None, None)] * table.num_rows
    known = spec.model.lora
    lenient = spec.input.format == "openai_batch"
    out: list[tuple[str | None, str | None]] = []
    for value in table.column(column).to_pylist():
        out.append(_one(value, known, column, lenient))
    return out


def _one(value: Any, known: dict[str, str], column: str, lenient: bool) -> tuple[str | None, str | None]:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, None
    if isinstance(value, str) and value in known:
        return value, None
    if lenient:
        return None, None
    names = ", ".join(sorted(known))
    return str(value), f"column {column!r}: adapter {value!r} is not in model.lora (the job's adapters: {names})"
