"""A Hugging Face `datasets` folder (made by `Dataset.save_to_disk`) as input, read with pyarrow
alone: the folder holds Arrow IPC stream files listed in its `state.json`, in row order.

Why no `datasets` import: a job needs none of its machinery (and none of its import time) to read
Arrow streams. A `DatasetDict` folder (`dataset_dict.json`, one folder per split) is refused with
a message naming its splits: a job reads one split, `input.path: <folder>/<split>`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from batchgen.errors import InputDataError

STATE = "state.json"
DICT = "dataset_dict.json"


def is_dataset_folder(fs: pafs.FileSystem, folder: str) -> bool:
    """Whether `folder` is a saved Dataset or DatasetDict (judged by its state files)."""
    infos = fs.get_file_info([f"{folder}/{STATE}", f"{folder}/{DICT}"])
    return any(info.type == pafs.FileType.File for info in infos)


def data_files(fs: pafs.FileSystem, folder: str, where: str) -> list[str]:
    """The paths of the folder's Arrow files, in the dataset's row order."""
    state = _read_json(fs, f"{folder}/{STATE}")
    if state is None:
        splits = _read_json(fs, f"{folder}/{DICT}")
        if splits is not None:
            names = ", ".join(splits.get("splits", [])) if isinstance(splits, dict) else "?"
            raise InputDataError(
                f"input.path {where}: a DatasetDict folder (splits: {names}); point input.path at one split's folder"
            )
        raise InputDataError(f"input.path {where}: no {STATE}: not a folder made by datasets' save_to_disk")
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, dict) and "filename" in f for f in files):
        raise InputDataError(f"input.path {where}/{STATE}: no list of data files (_data_files)")
    return [f"{folder}/{f['filename']}" for f in files]


def _read_json(fs: pafs.FileSystem, path: str) -> Any:
    """The JSON in `path`; None when there is no such file (asked of the filesystem, as
    is_dataset_folder does, not read from an error's wording)."""
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    try:
        with fs.open_input_stream(path) as fh:
            return json.loads(fh.read().decode("utf-8"))
    except (OSError, pa.ArrowException, ValueError) as exc:
        raise InputDataError(f"{path}: cannot read: {exc}") from exc


def stream_facts(source: Any, where: str) -> tuple[int, pa.Schema]:
    """(rows, schema) of one Arrow stream file: its batches are counted, not kept."""
    try:
        with pa.ipc.open_stream(source) as reader:
            rows = sum(batch.num_rows for batch in reader)
            return rows, reader.schema.remove_metadata()
    except (pa.ArrowException, OSError) as exc:
        raise InputDataError(f"{where}: not a readable Arrow stream file: {exc}") from exc


def stream_batches(source: Any, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The file's record batches with `columns` only, in order."""
    with pa.ipc.open_stream(source) as reader:
        for batch in reader:
            yield batch.select(columns)
