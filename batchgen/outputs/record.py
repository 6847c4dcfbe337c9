"""The job record (`_JOB.json`): its name, and the compare-and-swap every change to it goes through.

Why a module of its own: the record is written by the output's state (the fingerprint, as a run
starts), by each part's description (part_record) and by the runtimes that made parts
(runtime_record); each of them needs the record's name and the swap, and none the others.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from batchgen.errors import OutputError
from batchgen.storage.base import Storage

RECORD_NAME = "_JOB.json"
_SWAP_TRIES = 100  # compare-and-swap rounds before giving up (each lost round means another writer went first)


def update_record(storage: Storage, change: Callable[[dict[str, Any]], dict[str, Any] | None], fault: str) -> None:
    """Apply `change` (the record -> the new record, or None for no change) by compare-and-swap,
    reading again whenever another writer (a shard, a Ray worker) swapped it in between."""
    for _ in range(_SWAP_TRIES):
        text = storage.read_text(RECORD_NAME)
        if text is None:
            raise OutputError(f"{storage.describe(RECORD_NAME)}: the job record is gone (removed by another run?)")
        try:
            record = json.loads(text)
        except ValueError as exc:
            raise OutputError(f"{storage.describe(RECORD_NAME)}: cannot read the job record: {exc}") from exc
        new = change(record)
        if new is None or storage.swap_text(RECORD_NAME, json.dumps(new, indent=2, sort_keys=True), text, fault):
            return
    raise OutputError(f"{storage.describe(RECORD_NAME)}: other writers kept changing the job record; try again")
