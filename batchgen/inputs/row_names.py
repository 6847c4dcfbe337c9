"""What names a row: in messages (file, row index, the line of a text file, the id) and across runs
(its id, else its row_id, which row seeds are derived from); and the rows of a text file whose
line did not parse, failed first with what the reader found."""

from __future__ import annotations

import pyarrow as pa

from batchgen.inputs.dataset import InputFile
from batchgen.inputs.text_formats import LINE_COLUMN
from batchgen.job.spec import JobSpec


def row_ids(files: list[InputFile], file_index: list[int], file_row: list[int]) -> list[str]:
    """Each row's `row_id` (InputFile.row_ids): "<file key>:<row in the file>"."""
    return [f"{files[f].key}:{r}" for f, r in zip(file_index, file_row)]


def row_keys(spec: JobSpec, table: pa.Table, ids: list[str]) -> list[str]:
    """What identifies each row across runs: its id_column value, else its row_id (`ids`)."""
    if spec.input.id_column is not None:
        return [f"id:{v}" for v in table.column(spec.input.id_column).to_pylist()]
    return [f"row:{row_id}" for row_id in ids]


def row_labels(
    spec: JobSpec, files: list[InputFile], file_index: list[int], file_row: list[int], table: pa.Table
) -> list[str]:
    """Row names in error messages: file, row index (and line, for text formats), and id when the job has one."""
    base = [f"{files[f].path} row {i}" for f, i in zip(file_index, file_row)]
    if LINE_COLUMN in table.column_names:
        base = [f"{b} (line {n})" for b, n in zip(base, table.column(LINE_COLUMN).to_pylist())]
    if spec.input.id_column is None:
        return base
    return [f"{b} (id {v})" for b, v in zip(base, table.column(spec.input.id_column).to_pylist())]
