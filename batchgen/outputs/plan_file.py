"""The job's part layout, decided once per output: `_PLAN` (part -> input rows of the
prefix plan, batchgen.inputs.grouping) and the record's "grouping" key.

Why stored: resume, static shards and Ray workers must take the very same parts. The first run
of a job writes the plan with the conditional write parts use (never over an existing file: a
local hard link, an object store's put-if-absent); a run that finds one of this job reads it
and computes nothing; of runs starting at once one write lands and the others read it.

Layouts: an output whose record has no "grouping" key was made before prefix plans and resumes
as it was made (contiguous parts, no `input_row` column); a new output records
{"mode": "auto"} (parts from the plan) or {"mode": "none"} (contiguous parts), and has `input_row`.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import OutputError
from batchgen.inputs.dataset import InputFile, plan_shards
from batchgen.inputs.key_sort import Cut, run_bounds
from batchgen.inputs.part_rows import GroupedPart, Part
from batchgen.job.spec import JobSpec
from batchgen.storage.base import Storage

log = logging.getLogger(__name__)
# A Parquet file. Why no .parquet suffix: a job that reads this output folder as its input, or a
# `*.parquet` glob over it, must not take the plan for data.
PLAN_NAME = "_PLAN"
_META = b"batchgen.plan"


@dataclass
class Layout:
    """Which parts a job has, and what its output rows hold."""

    parts: list[Part]
    grouped: bool  # parts follow the prefix plan
    input_row: bool  # the output has INPUT_ROW_COLUMN (every output made since prefix plans)
    cut: Cut | None = None  # the plan, while not yet stored (see store)

    def runs(self, count: int, parts: list[Part] | None = None) -> list[list[Part]]:
        """`parts` (default: all) in `count` consecutive runs; a group's parts stay in one run."""
        parts = self.parts if parts is None else parts
        joined = [isinstance(p, GroupedPart) and p.joined for p in parts]
        bounds = run_bounds(joined, count)
        return [parts[bounds[r] : bounds[r + 1]] for r in range(count)]

    def owner(self, count: int) -> dict[int, int]:
        """Part index -> the static shard (of `count`) that owns it."""
        return {p.index: r for r, run in enumerate(self.runs(count)) for p in run}


def record_of(spec: JobSpec, grouped: bool) -> dict[str, Any]:
    """The record's "grouping" key of a new output."""
    facts: dict[str, Any] = {"mode": "auto" if grouped else "none"}
    if spec.input.group_column is not None:
        facts["group_column"] = spec.input.group_column
    return facts


def contiguous(spec: JobSpec, files: list[InputFile], input_row: bool) -> Layout:
    return Layout(list(plan_shards(files, spec.engine.window_rows, spec.input.limit)), False, input_row)


def grouped_layout(cut: Cut, stored: bool) -> Layout:
    parts: list[Part] = [
        GroupedPart(p, cut.rows[cut.starts[p] : cut.starts[p + 1]], cut.joined[p]) for p in range(len(cut.joined))
    ]
    return Layout(parts, True, True, None if stored else cut)


def read_plan(storage: Storage, job_id: str) -> Cut | None:
    """This job's stored plan; None when there is none, or it is another job's (a stale one)."""
    if not storage.exists(PLAN_NAME):
        return None
    try:
        table = pq.read_table(io.BytesIO(storage.read_bytes(PLAN_NAME)))
    except FileNotFoundError:
        return None
    except (OSError, pa.ArrowException) as exc:
        raise OutputError(f"{storage.describe(PLAN_NAME)}: cannot read the part plan: {exc}") from exc
    meta = json.loads((table.schema.metadata or {}).get(_META, b"{}"))
    if meta.get("job") != job_id:
        return None
    parts = table.column("part").to_numpy()
    starts = np.flatnonzero(np.diff(parts)) + 1
    bounds = [0, *starts.tolist(), len(parts)] if len(parts) else [0]
    return Cut(table.column("input_row").to_numpy().astype(np.int64), bounds, [bool(j) for j in meta["joined"]])


def store_plan(storage: Storage, cut: Cut, job_id: str, facts: dict[str, Any]) -> Cut:
    """Write this job's plan unless one is there; the plan every run of the job then uses."""
    found = read_plan(storage, job_id)
    if found is not None:
        return found
    if storage.exists(PLAN_NAME):  # another job's, left by a run that committed nothing: not ours to keep
        storage.delete(PLAN_NAME)
    sizes: np.ndarray = np.diff(np.asarray(cut.starts, dtype=np.int64)).astype(np.int64)
    meta = {"job": job_id, "joined": cut.joined, **facts}
    table = pa.table(
        {"part": pa.array(np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)), "input_row": pa.array(cut.rows)}
    ).replace_schema_metadata({_META: json.dumps(meta)})
    try:
        written = storage.write_parquet(PLAN_NAME, table, "plan_temp_write")
    except OSError as exc:
        raise OutputError(f"{storage.describe(PLAN_NAME)}: cannot write the part plan: {exc}") from exc
    if written:
        log.info("stored the part plan: %d parts", len(sizes))
        return cut
    theirs = read_plan(storage, job_id)  # another run of this job wrote it first: theirs stands
    if theirs is None:
        raise OutputError(f"{storage.describe(PLAN_NAME)}: another job's part plan appeared while this run started")
    return theirs
