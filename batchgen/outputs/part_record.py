"""What the job record (`_JOB.json`) says about each committed part, and the check a resume makes
before it keeps one.

Why: a resume keeps committed parts without recomputing them, so a part truncated (a bad copy, a
disk that lied) or replaced by another file would be trusted silently. Each part's exact bytes are
described in the record (rows, byte size, sha256) right BEFORE the part is committed, so every part
visible under its final name has its description, whichever of several racing writers wins (each
adds its own; the file that landed matches one of them). A resume reads each committed part whole,
keeps it only when it matches a description, and has the others deleted and generated again.

A part committed by an older batchgen has no description: it is kept when it reads as Parquet
with the rows its part should have, and described from then on.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.errors import OutputError
from batchgen.outputs.adapter_field import adapter_column, record_has_adapters
from batchgen.outputs.record import update_record
from batchgen.outputs.table import RESULT_NAMES
from batchgen.outputs.totals import Totals
from batchgen.storage.base import Storage

log = logging.getLogger(__name__)
CHECKS_KEY = "part_checks"  # record key: part name -> [description, ...]


@dataclass(frozen=True)
class PartFacts:
    """One committed part's description; `runtime` indexes the record's `runtimes` (None: unknown)."""

    rows: int
    size: int  # bytes
    sha256: str
    runtime: int | None = None

    @classmethod
    def of(cls, data: bytes, rows: int, runtime: int | None = None) -> PartFacts:
        return cls(rows, len(data), hashlib.sha256(data).hexdigest(), runtime)

    def as_json(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"rows": self.rows, "bytes": self.size, "sha256": self.sha256}
        return facts if self.runtime is None else {**facts, "runtime": self.runtime}


def describe_parts(storage: Storage, facts: Mapping[str, PartFacts]) -> None:
    """Add each part's description to the record (a part may have several: racing writers)."""

    def add(record: dict[str, Any]) -> dict[str, Any] | None:
        checks = dict(record.get(CHECKS_KEY, {}))
        for name, one in facts.items():
            known = checks.get(name, [])
            if one.as_json() not in known:
                checks[name] = [*known, one.as_json()]
        return None if checks == record.get(CHECKS_KEY, {}) else {**record, CHECKS_KEY: checks}

    update_record(storage, add, "part_record_write")


@dataclass
class Audit:
    """The committed parts a resume checked: `kept` (index -> its usage totals), `bad` (index -> why
    it cannot be trusted), `described` (parts of an older batchgen that passed, to be described)."""

    kept: dict[int, Totals] = field(default_factory=dict)
    bad: dict[int, str] = field(default_factory=dict)
    described: dict[str, PartFacts] = field(default_factory=dict)


def audit_parts(
    storage: Storage, committed: Mapping[int, str], rows: Mapping[int, int | None], record: Mapping[str, Any]
) -> Audit:
    """Check the committed parts among `rows` (part index -> the rows it must hold, None: unknown)."""
    audit = Audit()
    checks = record.get(CHECKS_KEY, {})
    adapters = record_has_adapters(record)  # (an older batchgen's adapter column is unmarked)
    for index, expected in rows.items():
        name = committed.get(index)
        if name is None:
            continue
        try:
            data = storage.read_bytes(name)
        except OSError as exc:
            raise OutputError(f"{storage.describe(name)}: cannot read a committed part: {exc}") from exc
        problem, table = part_problem(data, checks.get(name), expected, adapters)
        if problem is not None or table is None:
            audit.bad[index] = problem or "unreadable"
            continue
        audit.kept[index] = totals_of(table, adapters)
        if name not in checks:
            audit.described[name] = PartFacts.of(data, table.num_rows)
    return audit


def part_problem(
    data: bytes, described: list[dict[str, Any]] | None, rows: int | None, job_has_adapters: bool = False
) -> tuple[str | None, Any]:
    """(why `data` is not a part this job committed, or None; its usage columns when it is, with
    batchgen's adapter column when it has one: see adapter_field.adapter_column)."""
    if described:
        digest = hashlib.sha256(data).hexdigest()
        if not any(d["sha256"] == digest and d["bytes"] == len(data) for d in described):
            sizes = sorted({d["bytes"] for d in described})
            if len(data) not in sizes:
                return f"{len(data)} bytes where the job record says {sizes[0]} (truncated or replaced)", None
            return "its content is not what this job committed (sha256 differs: replaced)", None
    try:
        adapters = adapter_column(pq.read_schema(pa.BufferReader(data)), job_has_adapters)
        usage = RESULT_NAMES if adapters is None else [*RESULT_NAMES, adapters]  # per-adapter totals
        table = pq.read_table(pa.BufferReader(data), columns=usage)
    except (pa.ArrowException, OSError, ValueError) as exc:
        return f"not a readable part: {exc}", None
    if rows is not None and table.num_rows != rows:
        return f"{table.num_rows} rows where this part has {rows}", None
    return None, table


def totals_of(table: pa.Table, job_has_adapters: bool = False) -> Totals:
    """A part's usage totals (per adapter too when it has batchgen's adapter column)."""
    totals = Totals()
    totals.add_part(table.to_pydict(), adapter_column(table.schema, job_has_adapters))
    return totals


def redo_bad_parts(storage: Storage, committed: dict[int, str], audit: Audit) -> list[str]:
    """Delete the parts that failed their check (each logged naming it), so they are generated
    again, and describe the older ones that passed; the names of those deleted."""
    redone = []
    for index, why in sorted(audit.bad.items()):
        name = committed.pop(index)
        log.warning("%s: %s; not trusted: it is generated again", storage.describe(name), why)
        storage.delete(name)
        redone.append(name)
    if audit.described:
        log.info("described %d part(s) committed by an older batchgen in the job record", len(audit.described))
        describe_parts(storage, audit.described)
    return redone
