"""Which column of an output is batchgen's own per-row LoRA adapter column (`lora`).

Why not by its name alone: a job without adapters carries its input columns into the output, and
a user's column may well be called `lora`; read as adapter names it would turn into a bogus
per-adapter bill in `_SUCCESS` and `batchgen report`. batchgen marks the field it writes (Arrow
field metadata, which Parquet keeps), strips the mark from every column it carries from the input
(an earlier output read as input keeps its mark otherwise), and every reader asks `adapter_column`.

Outputs of the release before the mark have the column unmarked; their job record (`_JOB.json`)
names the job's adapters (a "lora" key, in every record since the column exists), and with adapters
`lora` is reserved for batchgen's column: such an output keeps its per-adapter totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

LORA_COLUMN = "lora"  # the output column naming each row's adapter (outputs/samples)
MARK_KEY = b"batchgen"
MARK = b"lora_adapter"  # MARK_KEY's value on batchgen's adapter field


def adapter_field() -> pa.Field:
    """The output's adapter column (null: the base model), marked as batchgen's."""
    return pa.field(LORA_COLUMN, pa.string(), metadata={MARK_KEY: MARK})


def is_marked(field: pa.Field) -> bool:
    return (field.metadata or {}).get(MARK_KEY) == MARK


def unmarked(field: pa.Field) -> pa.Field:
    """`field` without batchgen's mark (a carried input column is the user's data, whatever it held)."""
    if not is_marked(field):
        return field
    rest = {k: v for k, v in (field.metadata or {}).items() if k != MARK_KEY}
    return field.with_metadata(rest) if rest else field.remove_metadata()


def adapter_column(schema: pa.Schema, job_has_adapters: bool = False) -> str | None:
    """The name of batchgen's adapter column in `schema`, None when it has none.

    `job_has_adapters`: the job record (or the job) says the job has LoRA adapters; then an unmarked
    `lora` column is batchgen's too (written by the release before the mark)."""
    for field in schema:
        if is_marked(field):
            return field.name
    if job_has_adapters and LORA_COLUMN in schema.names:
        return LORA_COLUMN
    return None


def record_has_adapters(record: Mapping[str, Any] | None) -> bool:
    """Whether a job record (`_JOB.json`) is of a job with LoRA adapters (its fingerprint names them)."""
    return record is not None and "lora" in record
