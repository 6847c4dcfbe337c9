"""The inputs' two entry points, over every format: open the files of `input.path`, and stream
the rows of the wanted shards.

Why a module above dataset and formats: Parquet is opened and read in dataset, the other formats
in formats (which builds on dataset's InputFile and Shard); the choice between them is made here,
so neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.inputs.dataset import InputFile, Shard, check_column, read_parquet_shards
from batchgen.inputs.formats import open_any, read_file_shards


def open_inputs(
    pattern: str,
    required: list[str],
    exclude: Path | str | None = None,
    options: dict[str, Any] | None = None,
    fmt: str = "auto",
    named: list[str] | None = None,
) -> list[InputFile]:
    """Open every file (Parquet: its footer; other formats: see batchgen.inputs.formats); check the
    required columns exist with one type across files. `options`: the input's storage_options when
    `pattern` is an object-store URI; `fmt`: input.format; `named`: further columns the job names
    (carried ones), which an empty JSONL file is given as the required ones are."""
    files = [_named_columns(f, [*required, *(named or [])]) for f in open_any(pattern, fmt, options or {}, exclude)]
    for column in required:
        check_column(files, column)
    return files


def _named_columns(f: InputFile, names: list[str]) -> InputFile:
    """An empty JSONL file names no keys: give it the job's columns, typed null (no values), so a
    job whose input has no rows still knows its columns and writes its one empty part."""
    if f.format != "jsonl" or f.num_rows > 0:
        return f
    missing = [pa.field(n, pa.null()) for n in dict.fromkeys(names) if n not in f.schema.names]
    return replace(f, schema=pa.schema([*f.schema, *missing]))


def read_shards(files: list[InputFile], shards: list[Shard], columns: list[str]) -> Iterator[tuple[Shard, pa.Table]]:
    """Yield (shard, table of its rows), streaming each file once in record batches."""
    by_file: dict[int, list[Shard]] = {}
    for shard in shards:
        by_file.setdefault(shard.file_index, []).append(shard)
    for file_index in sorted(by_file):
        f = files[file_index]
        read = read_parquet_shards if f.format == "parquet" else read_file_shards
        yield from read(f, by_file[file_index], columns)
