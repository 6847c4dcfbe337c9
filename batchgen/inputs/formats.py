"""Which input format a job reads (input.format, or `auto`: the path's extension, or a `datasets`
folder's state files), and the non-Parquet formats opened as InputFiles and streamed by part.

Every format yields the same thing the rest of the pipeline knows: InputFiles with a row count and
a schema (so parts, resume, shards, Ray and fingerprints work unchanged) and, per part, an Arrow
table of the job's columns. Text formats add the hidden PROBLEM_COLUMN (a line that did not parse).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.errors import InputDataError, StoreUnavailable
from batchgen.inputs import hf_dataset, text_formats
from batchgen.inputs.dataset import READ_BATCH_ROWS, InputFile, Shard, discover, open_objects, open_parquet
from batchgen.inputs.shard_cut import cut_shards
from batchgen.storage.retry import is_transient
from batchgen.storage.uris import is_remote

SUFFIXES = {
    "parquet": (".parquet", ".pq"),
    "jsonl": (".jsonl", ".ndjson"),
    "csv": (".csv",),
    "openai_batch": (".jsonl",),
}
_NAMES = {"parquet": "Parquet", "jsonl": "JSONL", "csv": "CSV", "openai_batch": "OpenAI batch (.jsonl)"}


def resolve_format(pattern: str, declared: str, options: dict[str, Any] | None = None) -> str:
    """input.format, or for `auto`: a `datasets` folder (state.json / dataset_dict.json), else the
    extension of the file or glob (.jsonl / .ndjson, .csv, .parquet / .pq), else Parquet."""
    if declared != "auto":
        return declared
    name = pattern.rstrip("/").rsplit("/", 1)[-1].lower()
    for fmt in ("jsonl", "csv", "parquet"):
        if name.endswith(SUFFIXES[fmt]):
            return fmt
    fs, folder = _filesystem(pattern, options or {})
    try:
        if hf_dataset.is_dataset_folder(fs, folder):
            return "hf_dataset"
    except (OSError, pa.ArrowException):
        pass  # not reachable as a folder: the Parquet path reports what is wrong
    return "parquet"


def _filesystem(pattern: str, options: dict[str, Any]) -> tuple[pafs.FileSystem, str]:
    if is_remote(pattern):
        from batchgen.storage.objectstore import make_filesystem

        return make_filesystem(pattern, options, "input.path")
    return pafs.LocalFileSystem(), str(Path(pattern).absolute())


def open_any(pattern: str, declared: str, options: dict[str, Any], exclude: Path | str | None) -> list[InputFile]:
    """The job's input files in its format, each opened (rows counted, schema known)."""
    fmt = resolve_format(pattern, declared, options)
    if fmt == "parquet":
        return open_parquet(pattern, exclude, options)
    if fmt == "hf_dataset":
        return _open_dataset_folder(pattern, options)

    def opener(path: Path | str, key: str, fs: Any = None, fs_path: str = "") -> InputFile:
        return open_text(path, key, fmt, fs, fs_path)

    if is_remote(pattern):
        found = open_objects(pattern, options, exclude, opener, SUFFIXES[fmt], _NAMES[fmt])
        return _not_openai_batch(found) if declared == "auto" else found
    local_exclude = exclude if isinstance(exclude, Path) else None
    files = [opener(p, key) for p, key in discover(pattern, local_exclude, SUFFIXES[fmt], _NAMES[fmt])]
    return _not_openai_batch(files) if declared == "auto" else files


def _not_openai_batch(files: list[InputFile]) -> list[InputFile]:
    """Why: a file of OpenAI batch requests read as plain JSONL would fail on its missing prompt
    column with no hint of what it is; say which format reads it."""
    for f in files:
        if f.format == "jsonl" and {"custom_id", "url", "body"} <= set(f.schema.names):
            raise InputDataError(f"{f.path}: a file of OpenAI batch requests; set input.format: openai_batch")
    return files


def open_text(path: Path | str, key: str, fmt: str, fs: Any = None, fs_path: str = "") -> InputFile:
    """A JSONL / CSV / OpenAI batch file, scanned once: rows, column types, seek points."""
    f = InputFile(path, 0, pa.schema([]), key, fs, fs_path, fmt)
    try:
        with f.open_binary() as fh:
            found = text_formats.scan(fmt, fh, str(path))
    except (pa.ArrowException, OSError) as exc:
        raise InputDataError(f"{path}: cannot read: {exc}") from exc
    return InputFile(path, found.num_rows, found.schema, key, fs, fs_path, fmt, found.index)


def _open_dataset_folder(pattern: str, options: dict[str, Any]) -> list[InputFile]:
    fs, folder = _filesystem(pattern, options)
    remote = is_remote(pattern)
    scheme = pattern.split("://", 1)[0] if remote else ""
    files = []
    for fs_path in hf_dataset.data_files(fs, folder, pattern):
        key = fs_path[len(folder) + 1 :]
        path: Path | str = f"{scheme}://{fs_path}" if remote else Path(fs_path)
        try:
            with fs.open_input_file(fs_path) as fh:
                rows, schema = hf_dataset.stream_facts(fh, str(path))
        except (FileNotFoundError, OSError) as exc:
            raise InputDataError(f"{path}: listed in state.json but cannot be read: {exc}") from exc
        files.append(
            InputFile(path, rows, schema, key, fs if remote else None, fs_path if remote else "", "hf_dataset")
        )
    if not files:
        raise InputDataError(f"input.path {pattern}: the dataset lists no data files")
    return files


def read_file_shards(f: InputFile, shards: list[Shard], columns: list[str]) -> Iterator[tuple[Shard, pa.Table]]:
    """(shard, table of its rows) for one non-Parquet file, in row order."""
    try:
        if f.format == "hf_dataset":
            yield from _arrow_shards(f, sorted(shards, key=lambda s: s.start), columns)
            return
        with f.open_binary() as fh:
            for shard in sorted(shards, key=lambda s: s.start):
                read = list(text_formats.read_rows(f.format, fh, f.index, f.schema, shard.start, shard.stop))
                if len(read) < shard.num_rows:
                    raise InputDataError(f"{f.path}: file ended before row {shard.stop} (changed since it was opened?)")
                lines, rows = [line for line, _ in read], [row for _, row in read]
                yield shard, text_formats.rows_table(rows, lines, f.schema, columns)
    except (pa.ArrowException, OSError) as exc:
        if is_transient(exc):
            raise StoreUnavailable(f"{f.path}: reading rows failed on a transient store error: {exc}") from exc
        raise InputDataError(f"{f.path}: failed while reading rows: {exc}") from exc


def _arrow_shards(f: InputFile, pending: list[Shard], columns: list[str]) -> Iterator[tuple[Shard, pa.Table]]:
    """Shards of an Arrow stream file: batches arrive in order; rows before a wanted shard are
    dropped as they arrive, so memory stays one part plus one batch."""
    with f.open_binary() as fh:
        batches = (piece for batch in hf_dataset.stream_batches(fh, columns) for piece in _split(batch))
        yield from cut_shards(batches, pending)
    if pending:
        raise InputDataError(f"{f.path}: file ended before row {pending[0].stop} (changed since it was opened?)")


def _split(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    return [batch.slice(i, READ_BATCH_ROWS) for i in range(0, max(batch.num_rows, 1), READ_BATCH_ROWS)]
