"""Usage and cost from an output dataset: streams the committed parts' usage columns into
per-group token totals, row outcomes and exact length histograms, and cross-checks a finished
run's `_SUCCESS`. Rendering (records, JSON, CSV, terminal table) lives in render.

Memory is bounded by the number of groups times the number of DISTINCT token lengths (at most
the context length each), never by the number of rows: lengths are kept as exact integer
histograms, so p95 is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from batchgen.errors import InputDataError
from batchgen.outputs.adapter_field import adapter_column
from batchgen.outputs.record import RECORD_NAME
from batchgen.outputs.state import LOCK_NAME, SUCCESS_NAME
from batchgen.outputs.totals import BASE_NAME, IntHistogram, Totals, add_counts
from batchgen.storage.base import Storage
from batchgen.storage.open import open_storage
from batchgen.usage.success_check import OutputStatus, job_has_adapters, output_status

log = logging.getLogger(__name__)
USAGE_COLUMNS = ["finish_reason", "error_code", "input_tokens", "cached_tokens", "output_tokens"]
SAMPLE_TOKENS = "sample_output_tokens"  # n > 1: each sample's output tokens
REASONING_TOKENS = "reasoning_tokens"  # output.reasoning auto: the output tokens spent thinking
SCAN_BATCH_ROWS = 65536
NULL_NAME = "(null)"  # the group of rows whose --by value is null (but see _null_name: --by lora)


@dataclass
class GroupStats(Totals):
    """Usage of one group of output rows (or of all of them), with exact length histograms."""

    input_lengths: IntHistogram = field(default_factory=IntHistogram)  # ok rows only
    output_lengths: IntHistogram = field(default_factory=IntHistogram)  # ok rows only (samples when n > 1)
    samples: int = 0  # n > 1 only: the samples of all rows (the finish reasons counted)

    def merge(self, other: Totals) -> None:
        super().merge(other)
        if isinstance(other, GroupStats):
            self.samples += other.samples
            self.input_lengths.merge(other.input_lengths)
            self.output_lengths.merge(other.output_lengths)


@dataclass
class Report:
    path: Path | str  # a local folder or an object-store URI
    by: str | None
    groups: dict[str, GroupStats]  # group value as text, sorted; empty without --by
    totals: GroupStats
    status: OutputStatus
    per_sample: bool = False  # a job with n > 1: finish reasons and output lengths are per sample
    reasoning: bool = False  # the output has reasoning_tokens (output.reasoning auto)


def read_report(out_dir: str | Path, by: str | None = None) -> Report:
    """Stream every committed part of `out_dir` once; group by the `by` column when given.
    `out_dir` may be an object-store URI (options in its query or the store's environment)."""
    storage = open_storage(out_dir)
    out = storage.local_dir if storage.local_dir is not None else storage.where
    if not storage.is_dir():
        raise InputDataError(f"{out}: no such output folder")
    # Why committed_parts is enough: a part in flight has a hidden temporary name (".part-...tmp").
    parts = list(storage.committed_parts().values())
    started = any(storage.exists(name) for name in (LOCK_NAME, RECORD_NAME, SUCCESS_NAME))
    if not parts and not started:
        raise InputDataError(f"{out}: no committed part-*.parquet files (has the run started?)")
    groups: dict[str, GroupStats] = {}
    numeric = per_sample = reasoning = False
    adapters: str | None = None  # batchgen's adapter column (adapter_field), never a user's `lora`
    if parts:  # a run that started but committed nothing yet has empty totals
        schema = _dataset(storage, parts).schema
        numeric = _is_numeric(schema, by)
        per_sample = "finish_reason" in schema.names and pa.types.is_list(schema.field("finish_reason").type)
        reasoning = REASONING_TOKENS in schema.names
        adapters = adapter_column(schema, job_has_adapters(storage))
        for table in _scan(storage, parts, by, per_sample, reasoning, adapters):
            _add_table(groups, table, by, adapters)
    totals = GroupStats()
    for stats in groups.values():
        totals.merge(stats)
    status = output_status(storage, len(parts), totals, adapters is not None)
    if status.mismatches:
        log.error("%s: %s", out, status.line())
    ordered = {name: groups[name] for name in sorted(groups, key=_sort_key if numeric else None)} if by else {}
    return Report(out, by, ordered, totals, status, per_sample=per_sample, reasoning=reasoning)


def _dataset(storage: Storage, parts: list[str]) -> ds.Dataset:
    try:
        return storage.dataset(parts)
    except (pa.ArrowException, OSError) as exc:
        raise InputDataError(f"{storage.where}: cannot read the committed parts: {exc}") from exc


def _is_numeric(schema: pa.Schema, by: str | None) -> bool:
    """Whether groups of `by` sort as numbers (1, 2, 10) rather than as text (1, 10, 2)."""
    if by is None or by not in schema.names:
        return False
    kind = schema.field(by).type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)


def _sort_key(name: str) -> tuple[int, Decimal]:
    """Numeric group order: null first (as in text order), then by value, NaN last."""
    if name == NULL_NAME:
        return (0, Decimal(0))
    value = Decimal(name)
    return (2, Decimal(0)) if value.is_nan() else (1, value)


def _scan(
    storage: Storage,
    parts: list[str],
    by: str | None,
    per_sample: bool = False,
    reasoning: bool = False,
    adapters: str | None = None,
) -> Iterator[pa.Table]:
    out_dir = storage.where
    dataset = _dataset(storage, parts)
    names = dataset.schema.names
    missing = [c for c in USAGE_COLUMNS if c not in names]
    if missing:
        raise InputDataError(f"{out_dir}: not a batchgen output: no column(s) {missing}")
    if by is not None and by not in names:
        raise InputDataError(f"--by {by!r}: {out_dir} has no such column (columns: {', '.join(names)})")
    if by is not None and pa.types.is_nested(dataset.schema.field(by).type):
        raise InputDataError(f"--by {by!r}: column type {dataset.schema.field(by).type} cannot be grouped on")
    columns = USAGE_COLUMNS + ([SAMPLE_TOKENS] if per_sample else []) + ([REASONING_TOKENS] if reasoning else [])
    columns += [by] if by is not None and by not in columns else []
    columns += [adapters] if adapters is not None and adapters not in columns else []  # per-adapter usage
    try:
        for batch in dataset.scanner(columns=columns, batch_size=SCAN_BATCH_ROWS).to_batches():
            if batch.num_rows:
                yield pa.Table.from_batches([batch])
    except (pa.ArrowException, OSError) as exc:
        raise InputDataError(f"{out_dir}: failed while reading the parts: {exc}") from exc


def _add_table(groups: dict[str, GroupStats], table: pa.Table, by: str | None, adapters: str | None = None) -> None:
    """Fold one batch of rows into the per-group stats (vectorized group-bys, no per-row Python);
    `adapters`: batchgen's adapter column (per-adapter usage), None: the output has none."""
    keys = [by] if by is not None else []
    null = _null_name(by, adapters)
    per_sample = pa.types.is_list(table.schema.field("finish_reason").type)
    reasons = [] if per_sample else ["finish_reason"]
    sums = ["input_tokens", "cached_tokens", "output_tokens"] + [
        c for c in [REASONING_TOKENS] if c in table.schema.names
    ]
    named = [adapters] if adapters is not None else []
    outcome = table.group_by(list(dict.fromkeys(keys + reasons + ["error_code"] + named)), use_threads=False).aggregate(
        [*((c, "sum") for c in sums), ([], "count_all")]
    )
    for row in outcome.to_pylist():
        stats = groups.setdefault(_group_name(row, by, null), GroupStats())
        count, code = row["count_all"], row["error_code"]
        stats.rows += count
        add_counts(stats.error_codes, {code: count} if code is not None else {})
        stats.ok_rows += count if code is None else 0
        if not per_sample:
            add_counts(stats.finish_reasons, {_text(row["finish_reason"]): count})
        stats.input_tokens += row["input_tokens_sum"] or 0
        stats.cached_tokens += row["cached_tokens_sum"] or 0
        stats.output_tokens += row["output_tokens_sum"] or 0
        stats.reasoning_tokens += row.get(f"{REASONING_TOKENS}_sum") or 0
        if adapters is not None:
            _add_adapter(stats, row, adapters)
    if per_sample:
        _add_sample_reasons(groups, table, by, null)
    ok = table.filter(pc.is_null(table.column("error_code")))
    if ok.num_rows and per_sample:
        _add_lengths(groups, ok, by, (INPUT_LENGTHS,), null)
        _add_lengths(groups, _per_sample_rows(ok, by), by, (OUTPUT_LENGTHS,), null)
    elif ok.num_rows:
        _add_lengths(groups, ok, by, (INPUT_LENGTHS, OUTPUT_LENGTHS), null)


def _add_adapter(stats: GroupStats, row: dict[str, Any], adapters: str) -> None:
    """A job with LoRA adapters: one aggregated row's usage under its adapter ("(base)": none)."""
    name = BASE_NAME if row[adapters] is None else row[adapters]
    counts = {
        "rows": row["count_all"],
        "ok": row["count_all"] if row["error_code"] is None else 0,
        "input": row["input_tokens_sum"] or 0,
        "cached": row["cached_tokens_sum"] or 0,
        "output": row["output_tokens_sum"] or 0,
    }
    add_counts(stats.by_lora.setdefault(name, dict.fromkeys(counts, 0)), counts)


def _add_sample_reasons(groups: dict[str, GroupStats], table: pa.Table, by: str | None, null: str) -> None:
    """n > 1: finish reasons counted per sample (each row holds a list of n)."""
    flat = _flatten(table, "finish_reason", by)
    keys = list(dict.fromkeys(([by] if by is not None else []) + ["finish_reason"]))
    for row in flat.group_by(keys, use_threads=False).aggregate([([], "count_all")]).to_pylist():
        stats = groups.setdefault(_group_name(row, by, null), GroupStats())
        add_counts(stats.finish_reasons, {_text(row["finish_reason"]): row["count_all"]})
        stats.samples += row["count_all"]


def _per_sample_rows(ok: pa.Table, by: str | None) -> pa.Table:
    """n > 1: one row per sample, its output tokens as `output_tokens` (input tokens once per row)."""
    flat = _flatten(ok, SAMPLE_TOKENS, by).rename_columns({SAMPLE_TOKENS: "output_tokens"})
    return flat


def _flatten(table: pa.Table, column: str, by: str | None) -> pa.Table:
    """One row per element of the list column `column`, with the `by` value of its row."""
    values = table.column(column).combine_chunks()
    columns: dict[str, Any] = {column: pc.list_flatten(values)}
    if by is not None and by != column:
        columns[by] = table.column(by).take(pc.list_parent_indices(values))
    return pa.table(columns)


INPUT_LENGTHS = ("input_tokens", "input_lengths")  # (column, GroupStats histogram)
OUTPUT_LENGTHS = ("output_tokens", "output_lengths")


def _add_lengths(
    groups: dict[str, GroupStats],
    ok: pa.Table,
    by: str | None,
    histograms: tuple[tuple[str, str], ...],
    null: str = NULL_NAME,
) -> None:
    """Length histograms of ok rows: rows sorted by group, then one vectorized count per group."""
    if by is None:
        names, index = ["all"], np.zeros(ok.num_rows, np.int64)
    else:
        column = ok.column(by).combine_chunks()
        if pa.types.is_dictionary(column.type):  # why: its own dictionary would keep nulls out of it
            column = column.cast(column.type.value_type)
        encoded = pc.dictionary_encode(column, null_encoding="encode")
        names = [_text(v, null) for v in encoded.dictionary.to_pylist()]
        index = encoded.indices.to_numpy(zero_copy_only=False)
    order = np.argsort(index, kind="stable")
    cuts = np.flatnonzero(np.diff(index[order])) + 1
    for column, attr in histograms:
        lengths = ok.column(column).fill_null(0).to_numpy()[order]
        for rows in np.split(np.arange(len(order)), cuts):
            stats = groups.setdefault(names[index[order[rows[0]]]], GroupStats())
            values, counts = np.unique(lengths[rows], return_counts=True)
            getattr(stats, attr).add_many(values, counts)


def _group_name(row: dict[str, Any], by: str | None, null: str = NULL_NAME) -> str:
    return "all" if by is None else _text(row[by], null)


def _null_name(by: str | None, adapters: str | None) -> str:
    """The name of the group of null `by` values. Why "(base)" for batchgen's adapter column: a null
    adapter is the base model, named so by `_SUCCESS`'s per-adapter totals too (an error row keeps
    the adapter name it asked for); a user's column that is merely named `lora` is any column."""
    return BASE_NAME if by is not None and by == adapters else NULL_NAME


def _text(value: Any, null: str = NULL_NAME) -> str:
    """A group's name (`null`: the name of the null value's group)."""
    return null if value is None else str(value)
