"""A local output folder, written with batchgen's local protocol: each file under a hidden temp
name, fsynced, then renamed into place (or hard-linked, which refuses to replace a committed
part), and the folder synced; the job record is swapped under a flock of its own. A reader, or a
run resumed after kill -9, never sees half a file under a final name.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchgen.errors import OutputError
from batchgen.faults import fault_point
from batchgen.storage.base import Storage, temp_name, temp_target


class LocalStorage(Storage):
    """A local folder, written with batchgen's local protocol (`atomic_write`)."""

    def __init__(self, folder: Path) -> None:
        self.local_dir = Path(folder)
        self.folder = self.local_dir
        self.where = str(folder)

    def prepare(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / temp_name("probe")
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"output.path {self.folder}: not writable: {exc.strerror or exc}") from exc

    def is_dir(self) -> bool:
        return self.folder.is_dir()

    def exists(self, name: str) -> bool:
        return (self.folder / name).exists()

    def read_text(self, name: str) -> str | None:
        try:
            return (self.folder / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str, fault: str, replace: bool = True) -> bool:
        return atomic_write(self.folder / name, lambda tmp: tmp.write_text(text, encoding="utf-8"), fault, replace)

    def swap_text(self, name: str, text: str, expected: str | None, fault: str) -> bool:
        """Compare and write under an exclusive flock of `.batchgen.NAME.lock` (dropped if we die)."""
        fd = os.open(self.folder / f".batchgen.{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.read_text(name) != expected:
                return False
            return self.write_text(name, text, fault, replace=expected is not None)
        finally:
            os.close(fd)  # drops the flock

    def write_parquet(
        self, name: str, table: pa.Table, fault: str, before_commit: Callable[[bytes], None] | None = None
    ) -> bool:
        def write(tmp: Path) -> None:
            pq.write_table(table, tmp)
            if before_commit is not None:
                before_commit(tmp.read_bytes())  # why read back: the bytes on disk are the ones described

        return atomic_write(self.folder / name, write, fault, replace=False)

    def delete(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    def names(self) -> list[str]:
        return [p.name for p in self.folder.iterdir() if p.is_file()] if self.folder.is_dir() else []

    def temp_names(self) -> list[str]:
        """Our temp files only (see temp_name): other hidden files here are the user's."""
        return [p.name for p in self.folder.glob(".*.tmp") if temp_target(p.name) is not None]

    def read_table(self, name: str, columns: list[str]) -> pa.Table:
        return pq.read_table(self.folder / name, columns=columns)

    def read_bytes(self, name: str) -> bytes:
        return (self.folder / name).read_bytes()

    def dataset(self, names: list[str]) -> ds.Dataset:
        return ds.dataset([str(self.folder / n) for n in names], format="parquet")


def atomic_write(final: Path, write: Callable[[Path], object], fault: str, replace: bool = True) -> bool:
    """Write `final` through a hidden temp file, fsync it, rename it into place, sync the folder.
    With `replace=False` an existing `final` is kept and False returned (a hard link, which fails
    when the name exists, commits instead of the rename).

    Why the finally: whatever stops the write (a full disk, a bad cast, an interrupt), the temp
    file is removed; after the rename it no longer exists and the unlink does nothing.
    """
    tmp = final.parent / temp_name(final.name)
    try:
        write(tmp)
        fault_point("disk_full")
        _fsync(tmp)
        fault_point(fault)
        if replace:
            os.replace(tmp, final)
        elif not _link_new(tmp, final):
            return False
        _fsync(final.parent)
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _link_new(tmp: Path, final: Path) -> bool:
    """Give `tmp` the name `final` unless that name exists; False if it does."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    except OSError:
        # Why: a file system without hard links; the check-then-rename leaves a tiny window.
        if final.exists():
            return False
        os.replace(tmp, final)
    return True


def _fsync(path: Path) -> None:
    """Flush a file, or a folder's entries (a rename is durable only once its folder is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
