"""The output folder's state across runs: the run lock, the job record (fingerprint), committed
parts, leftovers of a killed run, and --overwrite. The state is read and written through a
`storage.Storage` (a local folder or an object-store prefix); the lock is a flock on local folders
and a lease object on object stores (lease.py)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batchgen.errors import FingerprintMismatch, LockedError, OutputError
from batchgen.inputs.sharding import ShardSpec
from batchgen.outputs.adapter_field import adapter_column
from batchgen.outputs.fingerprint import describe_difference
from batchgen.outputs.lease import ObjectLease
from batchgen.outputs.parts import write_problem
from batchgen.outputs.plan_file import PLAN_NAME
from batchgen.outputs.record import RECORD_NAME
from batchgen.outputs.table import RESULT_NAMES
from batchgen.outputs.totals import Totals
from batchgen.storage.base import PART_NAME, Storage, temp_target
from batchgen.storage.open import open_storage

log = logging.getLogger(__name__)
LOCK_NAME = ".batchgen.lock"
SUCCESS_NAME = "_SUCCESS"
BATCH_OUTPUT_NAME = "_batch_output.jsonl"  # output.format openai_batch (outputs/openai_batch.py)
# Record keys that runs of one job add to as they go (part_record, runtime_record): a refreshed record keeps them.
ACCUMULATED = ("part_checks", "runtimes")


class OutputLock:
    """flocks on the output folder. The kernel drops them when the holder dies, even by kill -9,
    so a killed run never blocks the next one.

    A plain run holds `.batchgen.lock` exclusively. A shard run (`shard`) and `finalize`
    (`shared=True`) hold it shared, so they run beside each other but never beside a plain run;
    a shard run also holds its own `.batchgen.shard-I-of-N.lock` exclusively.

    An object store has no flock: there the same rules hold through a lease object of the same
    name (lease.py), renewed while the run lives and expiring when it is killed.
    """

    def __init__(self, out_dir: Path | Storage, shard: ShardSpec | None = None, shared: bool = False) -> None:
        storage = open_storage(out_dir)
        folder = storage.local_dir
        self.enabled = folder is not None
        self.path = (folder or Path()) / LOCK_NAME
        self.shard = shard
        self.shared = shared or shard is not None
        self.fds: list[int] = []
        self.storage = storage
        self.lease = None if folder is not None else ObjectLease(storage, str(shard) if shard else None, shared)

    def acquire(self) -> None:
        if self.lease is not None:
            self.lease.acquire()
            self.storage.guard = self.lease.check  # every later write first checks the lease is still ours
            return
        try:
            main = self._open(self.path)
            if not self._try(main, fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX):
                raise LockedError(f"{self.path.parent}: another run is writing this output ({self._holders(main)})")
            if not self.shared:
                self._write_holder(main)
                return
            os.ftruncate(main, 0)  # why: holding it shared proves no plain run holds it; its text is stale
            if self.shard is not None:
                own = self._open(self.path.parent / self.shard.lock_name)
                if not self._try(own, fcntl.LOCK_EX):
                    holder = _read_holder(own)
                    raise LockedError(
                        f"{self.path.parent}: another run of shard {self.shard} is writing this output ({holder})"
                    )
                self._write_holder(own)
        except BaseException:
            self.release()
            raise

    def check(self, fresh: bool = False) -> None:
        """LockedError when this run no longer holds the output (an object store's lease lost);
        `fresh`: renew the lease first, so the answer holds for a lease's lifetime from now."""
        if self.lease is not None:
            if fresh:
                self.lease.renew()
            self.lease.check()

    def release(self) -> None:
        if self.lease is not None:
            self.storage.guard = None
            self.lease.release()
        for fd in reversed(self.fds):
            os.close(fd)  # closing drops the flock; the file stays, harmlessly
        self.fds = []

    def _open(self, path: Path) -> int:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise OutputError(f"{path}: cannot create the run lock: {exc.strerror or exc}") from exc
        self.fds.append(fd)
        return fd

    @staticmethod
    def _try(fd: int, mode: int) -> bool:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def _holders(self, fd: int) -> str:
        """Who holds the main lock: a plain run's own text, else (held shared) the shard runs."""
        holder = _read_holder(fd)
        if holder != "unknown process" or not list(self.path.parent.glob(".batchgen.shard-*.lock")):
            return holder
        return f"shard runs or finalize; see {self.path.parent}/.batchgen.shard-*.lock"

    @staticmethod
    def _write_holder(fd: int) -> None:
        holder = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)


def _read_holder(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown process"


class OutputState:
    """What a previous run left in the output folder, and the decisions about it."""

    def __init__(self, out_dir: Path | Storage) -> None:
        self.storage = open_storage(out_dir)
        self.out_dir = self.storage.local_dir if self.storage.local_dir is not None else self.storage.where
        self._checked = False
        self._seen: str | None = None  # the record's text when check_record read it (None: none)

    def overwrite(self) -> int:
        """Remove what batchgen wrote here (manifest, parts, temp files, record; nothing else);
        the number of parts removed. Why this order: stopped half way, the folder never holds a
        `_SUCCESS` beside missing parts, nor parts without the record of the job that made them."""
        parts = list(self.committed_parts().values())
        for name in [BATCH_OUTPUT_NAME, SUCCESS_NAME, *parts, *self.storage.temp_names(), PLAN_NAME, RECORD_NAME]:
            self.storage.delete(name)
        return len(parts)

    def check_record(self, fingerprint: dict[str, Any]) -> bool:
        """True when this job already finished here. Refuses a folder made by a different job.
        Remembers the record it read, the only one claim_record will write over."""
        self._seen, self._checked = self._read_record_text(), True
        if self._seen is None:
            if self.committed_parts():
                raise FingerprintMismatch(
                    f"{self.out_dir}: holds parts but no {RECORD_NAME}; not a batchgen output of this job "
                    "(use --overwrite to replace it)"
                )
            return False
        old = self._parse_record(self._seen) or {}
        if old.get("id") != fingerprint["id"] and not self.committed_parts():
            # Why: a run that failed before its first commit (bad override, model not loadable)
            # produced nothing; the folder belongs to no job yet and the corrected rerun starts.
            log.info("%s: the previous job committed no part; starting afresh", self.out_dir)
            self.storage.delete(SUCCESS_NAME)
            return False
        if old.get("id") != fingerprint["id"]:
            lines = "\n  ".join(describe_difference(old, fingerprint))
            raise FingerprintMismatch(
                f"{self.out_dir}: made by a different job; use --overwrite to replace it. What differs:\n  {lines}"
            )
        return self.storage.exists(SUCCESS_NAME)

    def read_success(self) -> dict[str, Any]:
        """The `_SUCCESS` manifest of a finished run."""
        manifest: dict[str, Any] = json.loads(self.storage.read_text(SUCCESS_NAME) or "{}")
        return manifest

    def claim_record(self, record: dict[str, Any], refresh: bool) -> None:
        """Write the job record as a run starts, over the very record check_record read: of runs
        starting at once only one write lands, and the others go by the record they then read
        (this job's: go on, as N shard runs do; another job's: refused). `refresh` (a plain run):
        write even over this job's own record, with this run's facts; else (a shard run) keep a
        record this job already wrote with its run facts."""
        if not self._checked:
            raise RuntimeError("claim_record needs check_record first (it writes over what that read)")
        old = self._parse_record(self._seen)
        if refresh or old is None or old.get("id") != record["id"] or "run" not in old:
            if old is not None and old.get("id") == record["id"]:  # why: what the parts' checks need stays
                record = {**record, **{k: old[k] for k in ACCUMULATED if k in old}}
            text = json.dumps(record, indent=2, sort_keys=True)
            try:
                self.storage.swap_text(RECORD_NAME, text, self._seen, "record_temp_write")
            except OSError as exc:
                where = self.storage.describe(RECORD_NAME)
                raise OutputError(f"{where}: cannot write: {write_problem(exc)}") from exc
        now = self.read_record() or {}
        if now.get("id") != record["id"]:
            lines = "\n  ".join(describe_difference(now, record))
            raise FingerprintMismatch(f"{self.out_dir}: another job claimed this output at the same time:\n  {lines}")

    def read_record(self) -> dict[str, Any] | None:
        return self._parse_record(self._read_record_text())

    def _read_record_text(self) -> str | None:
        try:
            return self.storage.read_text(RECORD_NAME)
        except (OSError, UnicodeDecodeError) as exc:
            raise OutputError(f"{self.storage.describe(RECORD_NAME)}: cannot read the job record: {exc}") from exc

    def _parse_record(self, text: str | None) -> dict[str, Any] | None:
        try:
            return None if text is None else json.loads(text)
        except ValueError as exc:
            raise OutputError(f"{self.storage.describe(RECORD_NAME)}: cannot read the job record: {exc}") from exc

    def remove_leftovers(self, owns: Callable[[int], bool] | None = None) -> int:
        """Delete temp files of a killed run: they were never committed. With `owns` (a shard
        run: others may be writing right now) only the temp files of the parts it owns."""
        leftovers = self.storage.temp_names()
        if owns is not None:
            leftovers = [n for n in leftovers if (i := _temp_part_index(n)) is not None and owns(i)]
        for name in leftovers:
            self.storage.delete(name)
        return len(leftovers)

    def committed_parts(self) -> dict[int, str]:
        """Committed parts by index, as names in the output folder."""
        return self.storage.committed_parts()

    def totals_of(self, part: str | Path, job_has_adapters: bool = False) -> Totals:
        """The usage totals of one committed part (named, or by a path whose name is used); per
        adapter too when it has batchgen's adapter column (`job_has_adapters`: see adapter_column)."""
        totals, name = Totals(), Path(part).name
        adapters = adapter_column(self.storage.dataset([name]).schema, job_has_adapters)
        table = self.storage.read_table(name, RESULT_NAMES if adapters is None else [*RESULT_NAMES, adapters])
        totals.add_part(table.to_pydict(), adapters)
        return totals


def _temp_part_index(name: str) -> int | None:
    """The part index of a part's temp file (".batchgen.part-000003.parquet.<hex>.tmp"), else None."""
    match = PART_NAME.fullmatch(temp_target(name) or "")
    return int(match.group(1)) if match else None
