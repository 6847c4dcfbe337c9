"""Committing the output's parts: part names, `PartWriter` (each part described in the job record,
then committed whole, never over a committed one) and the `_SUCCESS` manifest. The writes go
through a `storage.base.Storage`: on a local folder by its atomic protocol (storage/local.py), on
an object store by one conditional request per object (storage/objectstore.py)."""

from __future__ import annotations

import errno
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import OutputError
from batchgen.faults import fault_point
from batchgen.outputs.part_record import PartFacts, describe_parts
from batchgen.outputs.runtime_record import claim_runtime
from batchgen.storage.base import Storage
from batchgen.storage.open import open_storage


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


class PartWriter:
    """Commits each part whole: locally under a hidden temporary name, renamed (hard-linked) when
    complete; on an object store by one write of the whole object. A reader (or a resumed run)
    never sees half a part under a final name.

    Each part is described in the job record (rows, bytes, sha256: `part_record`) just before its
    commit, tagged with the runtime this process claimed (`claim_runtime`; the claim is kept for
    the writer's later parts, so a Ray worker claims once, with its pickled copy).

    `out_dir` is a local folder, an `s3://` / `gs://` URI (with `storage_options`) or a Storage.
    """

    def __init__(
        self,
        out_dir: Path | str | Storage,
        schema: pa.Schema,
        storage_options: Mapping[str, Any] | None = None,
        single_writer: bool = False,
        allow_runtime_change: bool = False,
    ) -> None:
        self.storage = open_storage(out_dir, storage_options, single_writer)
        self.schema = schema
        self.allow_runtime_change = allow_runtime_change
        self.runtime: int | None = None  # index in the record's runtimes, once claimed

    def claim_runtime(self, resolved: Mapping[str, str]) -> None:
        """Claim this process's resolved runtime in the job record (see runtime_record); once."""
        if self.runtime is None:
            self.runtime = claim_runtime(self.storage, resolved, self.allow_runtime_change)

    def prepare(self) -> None:
        self.storage.prepare()

    def write_part(self, index: int, table: pa.Table) -> PartFacts | None:
        """Commit part `index`: its description; None when it was already committed (by a concurrent
        shard run of another N): the existing part is kept, never replaced, so each row lands once."""
        name = part_name(index)
        described: list[PartFacts] = []

        def describe(data: bytes) -> None:
            described.append(PartFacts.of(data, table.num_rows, self.runtime))
            describe_parts(self.storage, {name: described[-1]})

        try:
            committed = self.storage.write_parquet(name, table.cast(self.schema), "after_temp_write", describe)
            fault_point("after_rename")
        except OSError as exc:
            raise OutputError(f"{self.storage.describe(name)}: cannot write part: {write_problem(exc)}") from exc
        return described[-1] if committed else None

    def write_success(self, manifest: dict[str, Any]) -> Path | str:
        return write_success(self.storage, manifest)


def write_success(out_dir: Path | Storage, manifest: dict[str, Any]) -> Path | str:
    """The `_SUCCESS` manifest, replaced atomically: concurrent writers of the same totals are safe."""
    storage = open_storage(out_dir)
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    try:
        storage.write_text("_SUCCESS", text, "success_temp_write")
    except OSError as exc:
        raise OutputError(f"{storage.describe('_SUCCESS')}: cannot write the manifest: {write_problem(exc)}") from exc
    return storage.local_dir / "_SUCCESS" if storage.local_dir is not None else storage.describe("_SUCCESS")


def write_problem(exc: OSError) -> str:
    """What went wrong in a write, for its message; a full disk says what to do about it."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{exc.strerror or exc}: the disk is full; committed parts are kept, free space and run again to resume"
    return str(exc.strerror or exc)
