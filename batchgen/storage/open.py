"""The Storage for an output path: the one place that chooses between a local folder and an
object store, so that neither needs to know the other."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchgen.errors import OutputError
from batchgen.storage.base import Storage
from batchgen.storage.local import LocalStorage
from batchgen.storage.objectstore import ObjectStorage
from batchgen.storage.uris import is_remote, local_path, options_from_uri


def open_storage(
    path: str | Path | Storage, options: Mapping[str, Any] | None = None, single_writer: bool = False
) -> Storage:
    """The Storage for an output path: a local folder (a plain path or `file://`) or an object-store
    URI, with its `storage_options` (a URI's query may add some). `single_writer`: see
    objectstore.ObjectStorage (a local folder always has atomic commits and needs no such mode)."""
    if isinstance(path, Storage):
        return path
    if not is_remote(path):
        if options:
            raise OutputError(f"output.storage_options: only for s3:// or gs:// paths, and {path} is local")
        return LocalStorage(Path(local_path(path) if isinstance(path, str) else path))
    uri, checked = options_from_uri(str(path), options, "output")
    return ObjectStorage(uri, checked, single_writer)
