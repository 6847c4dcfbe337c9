"""Input files: find them, check their schemas, plan shards, stream the rows of each shard.
Parquet is read here; the other formats (JSONL, CSV, OpenAI batch, `datasets` folders) are opened
and streamed by batchgen.inputs.formats through the same InputFile and Shard (inputs/reading chooses).

Each input file is named by its path relative to the input's root (`InputFile.key`): the folder
for a folder input, the fixed leading directories of a glob, the file's own folder for a single
file. The key is what `row_id` and the job fingerprint use, so it is unique within a job and the
same wherever the data is mounted. On an object store (`s3://bucket/prefix`) the prefix plays the
folder's part, through pyarrow.fs (`batchgen.storage.objectstore`).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import InputDataError, OutputError, StoreUnavailable
from batchgen.inputs.nested_outputs import skip_nested_outputs
from batchgen.inputs.shard_cut import cut_shards
from batchgen.storage.retry import RetryPolicy, is_transient, with_retries
from batchgen.storage.uris import is_remote, options_from_uri

READ_BATCH_ROWS = 4096  # rows decoded at a time: bounds memory even for one huge row group
READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class InputFile:
    path: Path | str  # absolute and normalised (no `..`), or the object's URI; for messages and the manifest
    num_rows: int
    schema: pa.Schema
    key: str = ""  # the path relative to the input's root, with "/" separators (see module doc)
    filesystem: Any = None  # an object store's pyarrow FileSystem; None: a local file
    fs_path: str = ""  # the object's path in `filesystem` ("bucket/key")
    format: str = "parquet"  # parquet | jsonl | csv | openai_batch | hf_dataset (see batchgen.inputs.formats)
    index: Any = None  # text formats: the RecordIndex of seek points made by the scan

    def source(self) -> Any:
        """What pyarrow reads: the local path, or the object opened for random access."""
        return self.path if self.filesystem is None else self.filesystem.open_input_file(self.fs_path)

    def open_binary(self) -> Any:
        """The file opened for reading bytes with seek (local or object store)."""
        return open(self.path, "rb") if self.filesystem is None else self.filesystem.open_input_file(self.fs_path)

    def row_ids(self, start: int, stop: int) -> list[str]:
        """`row_id` of rows [start, stop): "<key>:<row index>", unique within a job."""
        return [f"{self.key}:{i}" for i in range(start, stop)]


@dataclass(frozen=True)
class Shard:
    """A contiguous row range [start, stop) of one input file: ordered together, committed as one part."""

    index: int
    file_index: int
    start: int
    stop: int

    @property
    def num_rows(self) -> int:
        return self.stop - self.start


def discover(
    pattern: str, exclude: Path | None = None, suffixes: tuple[str, ...] = (".parquet",), kind: str = "Parquet"
) -> list[tuple[Path, str]]:
    """(path, key) of a file, a folder's files ending in `suffixes` (recursively) or a glob's files;
    sorted, never empty. Files under `exclude` (the job's output folder) are left out."""
    pattern = os.path.normpath(os.path.abspath(pattern))
    path = Path(pattern)
    if path.is_file():
        return [(path, path.name)]
    if path.is_dir():
        root, where = path, f"folder {path}"
        found = [p for p in path.rglob("*") if p.name.endswith(suffixes) and p.is_file() and not p.name.startswith(".")]
    else:
        root = _glob_root(pattern)
        where = f"glob {pattern!r}" if glob.has_magic(pattern) else f"path {pattern}"
        found = [Path(os.path.normpath(p)) for p in glob.glob(pattern, recursive=True) if Path(p).is_file()]
    files = sorted((p, p.relative_to(root).as_posix()) for p in found if not _inside(p, exclude))
    records = [r.relative_to(root).as_posix() for r in root.rglob("_JOB.json")] if root.is_dir() else []
    files = skip_nested_outputs(files, records, str(root))
    if not files:
        skipped = f" (the output folder {exclude} is not read as input)" if found else ""
        raise InputDataError(f"input.path: no {kind} files found at {where}{skipped}")
    return files


def _glob_root(pattern: str) -> Path:
    """The leading directories of a glob that hold no wildcard: its files' keys are relative to it."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts) - 1)
    return Path(*parts[:fixed])


def _inside(path: Path, folder: Path | None) -> bool:
    return folder is not None and path.resolve().is_relative_to(folder.resolve())


def planned_rows(files: list[InputFile], limit: int | None) -> int:
    """Rows a job reads: every row of every file, or the first `limit` of them."""
    total = sum(f.num_rows for f in files)
    return total if limit is None else min(total, limit)


def _open_one(path: Path | str, key: str, filesystem: Any = None, fs_path: str = "") -> InputFile:
    f = InputFile(path=path, num_rows=0, schema=pa.schema([]), key=key, filesystem=filesystem, fs_path=fs_path)
    try:
        with pq.ParquetFile(f.source()) as meta:
            num_rows, schema = meta.metadata.num_rows, meta.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise InputDataError(f"{path}: not a readable Parquet file: {exc}") from exc
    return InputFile(path, num_rows, schema, key, filesystem, fs_path)


Opener = Callable[[Path | str, str, Any, str], InputFile]  # (path, key, filesystem, fs path) -> opened file


def open_parquet(pattern: str, exclude: Path | str | None, options: dict[str, Any]) -> list[InputFile]:
    """Parquet inputs: a file, a folder's *.parquet, a glob, or the same on an object store."""
    if is_remote(pattern):
        return open_objects(pattern, options, exclude, _open_one)
    local_exclude = exclude if isinstance(exclude, Path) else None
    return [_open_one(p, key) for p, key in discover(pattern, local_exclude)]


def open_objects(
    uri: str,
    options: dict[str, Any],
    exclude: Path | str | None,
    opener: Opener,
    suffixes: tuple[str, ...] = (".parquet",),
    kind: str = "Parquet",
) -> list[InputFile]:
    """The input objects of an `s3://` / `gs://` URI (a prefix, an object or a glob), each opened."""
    from batchgen.inputs.objects import discover_objects
    from batchgen.storage.objectstore import bucket_problem, fs_path, make_filesystem

    policy = RetryPolicy.from_env()
    try:
        uri, checked = options_from_uri(uri, options, "input")
        fs, pattern = make_filesystem(uri, checked, "input.path", policy.attempts)
        skip = fs_path(exclude) if isinstance(exclude, str) and is_remote(exclude) else None
        found = with_retries(
            lambda: discover_objects(fs, pattern, uri, skip, suffixes), uri, "list the input objects", policy
        )
    except StoreUnavailable:
        raise
    except OutputError as exc:
        raise InputDataError(str(exc)) from None
    except (pa.ArrowException, OSError) as exc:
        raise InputDataError(f"input.path {uri}: cannot list the objects: {exc}") from exc
    if not found:
        problem = with_retries(lambda: bucket_problem(fs, pattern, uri), uri, "look up the bucket", policy)
        raise InputDataError(f"input.path {problem}" if problem else f"input.path: no {kind} objects found at {uri}")
    scheme = uri.split("://", 1)[0]
    return [opener(f"{scheme}://{p}", key, fs, p) for p, key in found]


def with_rows(files: list[InputFile]) -> list[InputFile]:
    """The files whose column types say something: those with rows (all of them when none has).
    Why: a file with no rows holds no value of any type (a header-only CSV types nothing, an empty
    JSONL file names no keys), so its types never refuse or change the job's."""
    return [f for f in files if f.num_rows > 0] or files


def check_column(files: list[InputFile], column: str, why: str = "") -> None:
    """`column` exists in every file with one type; else an InputDataError naming file and column.
    `why` is appended to a missing-column message (e.g. that the column is carried). An empty JSONL
    file (no keys) lacks no column; files with no rows take no part in the type check."""
    first_type = None
    for f in files:
        if column not in f.schema.names:
            if f.num_rows == 0 and f.format == "jsonl":
                continue
            raise InputDataError(f"{f.path}: no column {column!r}{why} (columns: {', '.join(f.schema.names)})")
    for f in with_rows(files):
        if column not in f.schema.names:
            continue
        col_type = f.schema.field(column).type
        if first_type is None:
            first_type = (f.path, col_type)
        elif common_type([col_type, first_type[1]]) is None:
            raise InputDataError(f"{f.path}: column {column!r} is {col_type} but {first_type[0]} has {first_type[1]}")


# Variants of one kind of value: pandas 3 writes text as large_string, pyarrow as string, and
# newer writers string_view. A column mixing them across files holds the same kind of values.
_FAMILIES = (
    ((pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view), pa.large_string()),
    ((pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view), pa.large_binary()),
)


def common_type(types: list[pa.DataType]) -> pa.DataType | None:
    """The one type a column has across files: the type itself when all are equal; for a mix of
    string-like (or of binary-like) variants the large one, which holds every value of the others;
    for a mix of numbers int64 (integers only) or double (any floating point: a CSV or JSONL file
    whose column holds whole numbers next to one whose column holds decimals); None otherwise."""
    if all(t == types[0] for t in types):
        return types[0]
    for members, widest in _FAMILIES:
        if all(any(member(t) for member in members) for t in types):
            return widest
    return _common_number(types)


def _common_number(types: list[pa.DataType]) -> pa.DataType | None:
    if not all(pa.types.is_integer(t) or pa.types.is_floating(t) for t in types):
        return None
    if any(pa.types.is_floating(t) for t in types):
        return pa.float64()
    return None if any(t == pa.uint64() for t in types) else pa.int64()  # why: uint64 does not fit int64


def column_field(files: list[InputFile], column: str) -> pa.Field:
    """`column`'s field for the output: the first file's, with the type every file's values fit
    (see common_type; check_column has refused types that do not agree)."""
    typed = [f for f in with_rows(files) if column in f.schema.names]
    field = typed[0].schema.field(column)
    unified = common_type([f.schema.field(column).type for f in typed])
    return field if unified is None or unified == field.type else field.with_type(unified)


def plan_shards(files: list[InputFile], window_rows: int, limit: int | None = None) -> list[Shard]:
    """Cut each file into windows of `window_rows` rows; `limit` keeps only the first rows overall."""
    shards: list[Shard] = []
    remaining = limit if limit is not None else sum(f.num_rows for f in files)
    for file_index, f in enumerate(files):
        start = 0
        while start < f.num_rows and remaining > 0:
            stop = min(start + window_rows, f.num_rows, start + remaining)
            shards.append(Shard(index=len(shards), file_index=file_index, start=start, stop=stop))
            remaining -= stop - start
            start = stop
    return shards


def _row_group_of(meta: pq.FileMetaData, row: int) -> tuple[int, int]:
    """(index of the row group holding file row `row`, that group's first row); (0, 0) for none."""
    first = 0
    for i in range(meta.num_row_groups):
        rows = meta.row_group(i).num_rows
        if row < first + rows:
            return i, first
        first += rows
    return 0, 0


def read_parquet_shards(f: InputFile, shards: list[Shard], columns: list[str]) -> Iterator[tuple[Shard, pa.Table]]:
    """(shard, its rows) of one Parquet file, streamed from the row group of the first wanted row."""
    pending = sorted(shards, key=lambda s: s.start)
    try:
        # Why buffered, not pre-buffered: a huge row group is then read page by page, not whole.
        reader = pq.ParquetFile(f.source(), buffer_size=READ_BUFFER_BYTES, pre_buffer=False)
        # why from the row group of the first wanted row: a worker given a late part of a big
        # file (Ray, a resumed run) does not decode every row before it
        first_group, offset = _row_group_of(reader.metadata, pending[0].start)
        groups = range(first_group, reader.metadata.num_row_groups)
        batches = reader.iter_batches(batch_size=READ_BATCH_ROWS, columns=columns, row_groups=groups)
        yield from cut_shards(batches, pending, offset)
    except (pa.ArrowException, OSError) as exc:
        if is_transient(exc):  # the store's retries were spent mid-stream: not the data's fault
            raise StoreUnavailable(f"{f.path}: reading rows failed on a transient store error: {exc}") from exc
        raise InputDataError(f"{f.path}: failed while reading rows: {exc}") from exc
    if pending:
        raise InputDataError(f"{f.path}: file ended before row {pending[0].stop} (truncated?)")
