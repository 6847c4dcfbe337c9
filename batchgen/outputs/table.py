"""What an output row holds: the output schema (carried input columns, then the result columns),
and one part's table built from prepared rows and engine outputs, in input row order."""

from __future__ import annotations

import re
from typing import Any

import pyarrow as pa

from batchgen.engine.api.outputs import RequestOutput
from batchgen.errors import InputDataError
from batchgen.inputs.prepared_row import PreparedRow
from batchgen.job.spec import JobSpec
from batchgen.outputs.adapter_field import LORA_COLUMN, unmarked
from batchgen.outputs.samples import ColumnPlan

RESULT_FIELDS = [
    pa.field("generated_text", pa.string()),
    pa.field("finish_reason", pa.string()),  # stop | length | error
    pa.field("stop_reason", pa.string()),  # the stop string, or a stop token id in decimal
    pa.field("input_tokens", pa.int64()),
    pa.field("cached_tokens", pa.int64()),
    pa.field("output_tokens", pa.int64()),
    pa.field("error_code", pa.string()),
    pa.field("error_message", pa.string()),
]
RESULT_NAMES = [f.name for f in RESULT_FIELDS]
ROW_ID_COLUMN = "row_id"  # added when the job names no id_column: see InputFile.row_ids
# The row's position over all input files (in file order): parts follow the prefix plan, not the
# input, so `ORDER BY input_row` gives input order back. In every output made since the plan existed.
INPUT_ROW_COLUMN = "input_row"
_ENGINE_REQUEST = re.compile(r"^request \d+: ")  # how the engine starts a refusal (its own request id)
# how the engine says an image's pixels did not decode (engine/vision/images.ImageDecodeError)
_DECODE_FAILURE = re.compile(r"^image (\d+)(: cannot decode.*)$", re.DOTALL)


def output_schema(
    carried: list[pa.Field], add_row_id: bool, results: list[pa.Field] | None = None, input_row: bool = False
) -> pa.Schema:
    """`results`: the job's result columns (ColumnPlan.fields); None: the base RESULT_FIELDS.
    `input_row`: the INPUT_ROW_COLUMN, before the results (an output made before it has none).
    A carried column loses batchgen's adapter mark (an earlier LoRA job's output read as input):
    only the job's own adapter column is read as per-adapter usage (outputs/adapter_field)."""
    fields = [unmarked(f) for f in carried]
    if add_row_id:
        fields.insert(0, pa.field(ROW_ID_COLUMN, pa.string()))
    if input_row:
        fields.append(pa.field(INPUT_ROW_COLUMN, pa.int64()))
    return pa.schema(fields + (RESULT_FIELDS if results is None else results))


def carried_columns(spec: JobSpec, schema: pa.Schema) -> list[str]:
    """Input columns copied into the output; they must not collide with the result columns."""
    wanted = spec.input.carry_columns if spec.input.carry_columns is not None else list(schema.names)
    if spec.input.id_column and spec.input.id_column not in wanted:
        wanted = [spec.input.id_column, *wanted]  # why: an output row must say which input row it is
    if spec.input.lora_column == LORA_COLUMN and spec.input.carry_columns is None:
        wanted = [c for c in wanted if c != LORA_COLUMN]  # why: the output's `lora` column holds its values
    missing = [c for c in wanted if c not in schema.names]
    if missing:
        raise InputDataError(f"input.carry_columns: no such column(s) {missing} (columns: {', '.join(schema.names)})")
    reserved = set(RESULT_NAMES) | {INPUT_ROW_COLUMN} | ({ROW_ID_COLUMN} if spec.input.id_column is None else set())
    reserved |= {f.name for f in ColumnPlan.of(spec).extra_fields()}
    clash = [c for c in wanted if c in reserved]
    if clash:
        raise InputDataError(
            f"input columns {clash} collide with batchgen's output columns; leave them out with input.carry_columns"
        )
    return wanted


def result_columns(
    rows: list[PreparedRow], outputs: dict[int, RequestOutput], plan: ColumnPlan | None = None
) -> dict[str, list[Any]]:
    """Result values per row: `outputs` maps a row index to its engine output (ok rows only)."""
    plan = plan or ColumnPlan()
    cols: dict[str, list[Any]] = {f.name: [] for f in plan.fields(RESULT_FIELDS)}
    for i, row in enumerate(rows):
        out = outputs.get(i)
        if out is not None and out.error is not None:
            code, message = "engine_error", engine_error_message(row.label, out.error)
            decode = _DECODE_FAILURE.match(_ENGINE_REQUEST.sub("", out.error, count=1))
            if decode is not None and row.images:  # an image whose pixels would not decode: the row's data
                j = int(decode.group(1))
                source = f" ({row.images[j].source})" if j < len(row.images) else ""
                code, message = "invalid_image", f"{row.label}: image {j}{source}{decode.group(2)}"
            row = PreparedRow(prompt_ids=row.prompt_ids, error_code=code, error_message=message, adapter=row.adapter)
            out = None
        _append(cols, row, out, plan)
    return cols


def engine_error_message(label: str, error: str) -> str:
    """An engine refusal named like every error row: by file, row and id. Why the prefix goes: the
    engine numbers requests in its own order ("request 7: ..."), which means nothing to a user."""
    text = _ENGINE_REQUEST.sub("", error, count=1)
    return f"{label}: {text}" if label else text


def _append(cols: dict[str, list[Any]], row: PreparedRow, out: RequestOutput | None, plan: ColumnPlan) -> None:
    if out is None:
        # Why zeros: usage is what was billed; an error row fed nothing to the model (its message says why).
        values: dict[str, Any] = {
            "input_tokens": 0,
            "cached_tokens": 0,
            "output_tokens": 0,
            "error_code": row.error_code or "engine_error",
            "error_message": row.error_message or "the engine returned no output",
        }
    else:
        values = {
            "input_tokens": len(row.prompt_ids or ()),
            "cached_tokens": out.num_cached_tokens,
            "output_tokens": out.num_output_tokens,
            "error_code": None,
            "error_message": None,
        }
    values.update(plan.values(out, row.params.logprobs if row.params is not None else None))
    if plan.lora:
        values[LORA_COLUMN] = row.adapter
    for name, value in values.items():
        cols[name].append(value)


def part_table(
    table: pa.Table,
    carried: list[str],
    row_ids: list[str] | None,
    results: dict[str, list[Any]],
    fields: list[pa.Field] | None = None,
) -> pa.Table:
    """`fields`: the job's result columns (ColumnPlan.fields); None: the base RESULT_FIELDS."""
    arrays: dict[str, pa.Array | pa.ChunkedArray] = {}
    if row_ids is not None:
        arrays[ROW_ID_COLUMN] = pa.array(row_ids, pa.string())
    for name in carried:
        arrays[name] = _valid_text(table.column(name))
    for f in RESULT_FIELDS if fields is None else fields:
        value = results[f.name]  # a pooling task's columns come built (outputs/pooled.pooled_array)
        arrays[f.name] = value if isinstance(value, pa.Array) else pa.array(value, f.type)
    return pa.table(arrays)


def _valid_text(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Carry a column as is, except that invalid UTF-8 in a string column (already reported as
    an error row) is replaced with U+FFFD so the output stays readable as one table."""
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return column
    try:
        column.validate(full=True)
        return column
    except pa.ArrowInvalid:
        raw = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
        fixed = [None if v is None else v.decode("utf-8", errors="replace") for v in raw.to_pylist()]
        return pa.chunked_array([pa.array(fixed, column.type)])
