"""The `Storage` interface: one output folder or prefix, whose files every reader and writer of an
output goes through (list the committed parts, read and write the small JSON files, read parts
back, commit a part whole without ever replacing one, swap the job record only over the one a run
read), and the names of the files batchgen writes there (parts, and the temp names they are
written under before their commit). Two implementations: `local.LocalStorage` (temp file, fsync,
rename or hard link, flocks: the run's in `outputs.state.OutputLock`, the record swap's own) and
`objectstore.ObjectStorage` (each object written by one request, visible whole or not at all,
conditionally where it must not replace another; no rename, no flock: the run lock is a lease,
outputs/lease.py); `open.open_storage` picks one for a path.
"""

from __future__ import annotations

import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

PART_NAME = re.compile(r"part-(\d{6})\.parquet")  # only these are ours; a stray part-old.parquet is not
# A file is written under a temp name, then committed under its final name. Why this exact pattern:
# a user's own hidden `.notes.tmp` in the output folder must never be taken for ours and deleted.
# (Older batchgen wrote ".<final>.<hex>.tmp": still matched, so its leftovers are cleaned too.)
_TEMP_PREFIX = ".batchgen."
TEMP_NAME = re.compile(
    r"\.(?:batchgen\.)?(part-\d{6}\.parquet|_SUCCESS|_JOB\.json|_PLAN|_batch_output\.jsonl|probe)\.[0-9a-f]{32}\.tmp"
)


def temp_name(final: str) -> str:
    """The hidden name `final` is written under before its commit: ".batchgen.<final>.<32 hex>.tmp"."""
    name = f"{_TEMP_PREFIX}{final}.{uuid.uuid4().hex}.tmp"
    if not TEMP_NAME.fullmatch(name):
        raise ValueError(f"{final!r} is not a file batchgen writes in an output folder")
    return name


def temp_target(name: str) -> str | None:
    """The final name a temp file of ours (see temp_name) was written for; None for any other file."""
    match = TEMP_NAME.fullmatch(name)
    return match.group(1) if match else None


class Storage(ABC):
    """One output folder or prefix; files are named relative to it (`_JOB.json`, `part-000003.parquet`)."""

    where: str  # the folder or URI, for messages
    local_dir: Path | None = None  # the folder when local: flocks and hard links work there
    guard: Callable[[], None] | None = None  # an object store: checks the run still holds its lease

    @abstractmethod
    def prepare(self) -> None:
        """Create the folder if needed and check it can be written; OutputError otherwise."""

    @abstractmethod
    def is_dir(self) -> bool: ...

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def read_text(self, name: str) -> str | None:
        """The file's text; None when there is no such file."""

    @abstractmethod
    def write_text(self, name: str, text: str, fault: str, replace: bool = True) -> bool:
        """Write `name` whole (never half visible); with `replace=False` keep an existing one and
        return False. `fault` names the crash-test point between preparing and committing."""

    @abstractmethod
    def swap_text(self, name: str, text: str, expected: str | None, fault: str) -> bool:
        """Write `name` whole only if its text is still `expected` (None: there is no such file);
        False, and nothing written, when it is not. Atomic against any other swap of `name`."""

    @abstractmethod
    def write_parquet(
        self, name: str, table: pa.Table, fault: str, before_commit: Callable[[bytes], None] | None = None
    ) -> bool:
        """Commit `table` as `name` whole; False (and the existing file kept) when it exists.
        `before_commit` gets the exact bytes about to be committed, before they can be seen."""

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def names(self) -> list[str]:
        """The files directly inside (not in sub-folders)."""

    @abstractmethod
    def temp_names(self) -> list[str]:
        """Temp files a killed writer left (none on object stores: nothing is written half)."""

    @abstractmethod
    def read_table(self, name: str, columns: list[str]) -> pa.Table: ...

    @abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """The whole file (FileNotFoundError when there is none)."""

    @abstractmethod
    def dataset(self, names: list[str]) -> ds.Dataset: ...

    def committed_parts(self) -> dict[int, str]:
        """Committed parts by index, as names (only `part-NNNNNN.parquet` files are ours)."""
        found = {int(m.group(1)): n for n in self.names() if (m := PART_NAME.fullmatch(n))}
        return dict(sorted(found.items()))

    def describe(self, name: str) -> str:
        return f"{self.where}/{name}"
