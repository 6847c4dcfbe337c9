"""The output folder's state across runs: the run lock, the job record (fingerprint), committed
parts, leftovers of a killed run, and --overwrite."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchgen.errors import FingerprintMismatch, LockedError, OutputError
from batchgen.fingerprint import describe_difference
from batchgen.output_table import RESULT_NAMES
from batchgen.parts import atomic_write, committed_parts
from batchgen.usage.totals import Totals

log = logging.getLogger(__name__)
LOCK_NAME = ".batchgen.lock"
RECORD_NAME = "_JOB.json"
SUCCESS_NAME = "_SUCCESS"


class OutputLock:
    """An exclusive flock on the output folder. The kernel drops it when the holder dies, even by
    kill -9, so a killed run never blocks the next one."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_NAME
        self.fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"{self.path}: cannot create the run lock: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "unknown process"
            os.close(fd)
            raise LockedError(f"{self.path.parent}: another run is writing this output ({holder})") from None
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.write(fd, holder.encode())
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, harmlessly
            self.fd = None


class OutputState:
    """What a previous run left in the output folder, and the decisions about it."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def overwrite(self) -> None:
        """Remove what batchgen wrote here (parts, record, manifest, temp files); nothing else."""
        for path in self._ours():
            path.unlink(missing_ok=True)

    def check_record(self, fingerprint: dict[str, Any]) -> bool:
        """True when this job already finished here. Refuses a folder made by a different job."""
        record_path = self.out_dir / RECORD_NAME
        if not record_path.exists():
            if self.committed_parts():
                raise FingerprintMismatch(
                    f"{self.out_dir}: holds parts but no {RECORD_NAME}; not a batchgen output of this job "
                    "(use --overwrite to replace it)"
                )
            return False
        old = json.loads(record_path.read_text(encoding="utf-8"))
        if old.get("id") != fingerprint["id"] and not self.committed_parts():
            # Why: a run that failed before its first commit (bad override, model not loadable)
            # produced nothing; the folder belongs to no job yet and the corrected rerun starts.
            log.info("%s: the previous job committed no part; starting afresh", self.out_dir)
            (self.out_dir / SUCCESS_NAME).unlink(missing_ok=True)
            return False
        if old.get("id") != fingerprint["id"]:
            lines = "\n  ".join(describe_difference(old, fingerprint))
            raise FingerprintMismatch(
                f"{self.out_dir}: made by a different job; use --overwrite to replace it. What differs:\n  {lines}"
            )
        return (self.out_dir / SUCCESS_NAME).exists()

    def write_record(self, fingerprint: dict[str, Any]) -> None:
        text = json.dumps(fingerprint, indent=2, sort_keys=True)
        try:
            atomic_write(
                self.out_dir / RECORD_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"), "record_temp_write"
            )
        except OSError as exc:
            raise OutputError(f"{self.out_dir / RECORD_NAME}: cannot write: {exc.strerror or exc}") from exc

    def remove_leftovers(self) -> int:
        """Delete temp files of a killed run: they were never committed."""
        leftovers = self._temp_files()
        for path in leftovers:
            path.unlink(missing_ok=True)
        return len(leftovers)

    def committed_parts(self) -> dict[int, Path]:
        return committed_parts(self.out_dir)

    def totals_of(self, path: Path) -> Totals:
        totals = Totals()
        totals.add_part(pq.read_table(path, columns=RESULT_NAMES).to_pydict())
        return totals

    def _ours(self) -> list[Path]:
        names = [RECORD_NAME, SUCCESS_NAME]
        paths = [self.out_dir / n for n in names] + list(self.committed_parts().values())
        return paths + self._temp_files()

    def _temp_files(self) -> list[Path]:
        return list(self.out_dir.glob(".*.tmp"))
