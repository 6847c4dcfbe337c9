"""What names a row: in messages (file, row index, the line of a text file, the id) and across runs
(its id, else its row_id, which row seeds are derived from); and the rows of a text file whose
line did not parse, failed first with what the reader found."""

from __future__ import annotations

import pyarrow as pa

from batchgen.inputs.dataset import InputFile, Shard
from batchgen.inputs.text_formats import LINE_COLUMN
from batchgen.job.spec import JobSpec


def row_keys(spec: JobSpec, f: InputFile, shard: Shard, table: pa.Table) -> list[str]:
    """What identifies each row across runs: its id_column value, else its row_id."""
    if spec.input.id_column is not None:
        return [f"id:{v}" for v in table.column(spec.input.id_column).to_pylist()]
    return [f"row:{row_id}" for row_id in f.row_ids(shard.start, shard.stop)]


def row_labels(spec: JobSpec, f: InputFile, shard: Shard, table: pa.Table) -> list[str]:
    """Row names in error messages: file, row index (and line, for text formats), and id when the job has one."""
    base = [f"{f.path} row {i}" for i in range(shard.start, shard.stop)]
    if LINE_COLUMN in table.column_names:
        base = [f"{b} (line {n})" for b, n in zip(base, table.column(LINE_COLUMN).to_pylist())]
    if spec.input.id_column is None:
        return base
    return [f"{b} (id {v})" for b, v in zip(base, table.column(spec.input.id_column).to_pylist())]
