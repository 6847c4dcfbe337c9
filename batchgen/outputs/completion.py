"""Finishing an output: the `_SUCCESS` manifest, written once every planned part is committed.

A plain run builds it from its own counters (it holds the whole output). A shard run that finds
every part committed after its own, and `batchgen finalize`, build it from the committed parts and
the job record (`_JOB.json` holds the facts a manifest needs: the planned parts, inputs, backend,
start time), so two shards finishing together write the same totals, and an explicit last
pipeline step can write it without the job file.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa

import batchgen
from batchgen.errors import IncompleteOutput, InputDataError
from batchgen.inputs.dataset import InputFile
from batchgen.job.spec import JobSpec
from batchgen.outputs.part_record import audit_parts
from batchgen.outputs.parts import part_name, write_success
from batchgen.outputs.record import RECORD_NAME
from batchgen.outputs.runtime_record import manifest_runtimes
from batchgen.outputs.state import SUCCESS_NAME, OutputLock, OutputState
from batchgen.outputs.totals import Totals
from batchgen.storage.open import open_storage

log = logging.getLogger(__name__)
SHOWN_MISSING = 5  # missing parts named in finalize's refusal; the rest are counted


def run_facts(spec: JobSpec, files: list[InputFile], num_parts: int, started: float) -> dict[str, Any]:
    """What the manifest needs besides totals; kept in `_JOB.json` (not part of the fingerprint)."""
    return {
        "parts": num_parts,
        "inputs": [f.path if isinstance(f.path, str) else os.path.normpath(os.path.abspath(f.path)) for f in files],
        "backend": spec.engine.backend,
        "started": started,
    }


def build_manifest(totals: Totals, record: dict[str, Any], started: float, wall: float, tokens: int) -> dict[str, Any]:
    """The `_SUCCESS` content; `tokens` output tokens over `wall` seconds give the rate."""
    facts = record["run"]
    counts = {"input": totals.input_tokens, "cached": totals.cached_tokens, "output": totals.output_tokens}
    if totals.reasoning_tokens:  # why only then: manifests of jobs without reasoning stay as they were
        counts["reasoning"] = totals.reasoning_tokens
    manifest = {
        "rows": {"total": totals.rows, "ok": totals.ok_rows, "error": totals.error_rows},
        "finish_reasons": totals.finish_reasons,
        "error_codes": totals.error_codes,
        "tokens": counts,
        "parts": facts["parts"],
        "inputs": facts["inputs"],
        "fingerprint": record["id"],
        "backend": facts["backend"],
        **manifest_runtimes(record),
        "versions": _versions(),
        "timings": {
            "started": datetime.fromtimestamp(started, timezone.utc).isoformat(),
            "wall_seconds": round(wall, 3),
            "output_tokens_per_second": round(tokens / wall, 2) if wall > 0 else None,
        },
    }
    if totals.by_lora:  # a job with LoRA adapters: rows and tokens per adapter ("(base)": none)
        manifest["lora"] = {name: dict(counts) for name, counts in sorted(totals.by_lora.items())}
    return manifest


def complete_from_parts(state: OutputState, record: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
    """Write `_SUCCESS` when every planned part is committed: (manifest, []); else (None, missing).

    Totals are summed from the committed parts, never from a process's counters: whichever shard
    (or finalize) writes it, and however many at once, the figures are the same. Timings span from
    the record's start (the first run of this output) to now. A part that fails its check against
    the record (part_record: truncated, replaced) counts as missing: its shard's rerun redoes it.
    """
    committed = state.committed_parts()  # why once: on an object store each listing is a request
    planned = record["run"]["parts"]
    missing = [i for i in range(planned) if i not in committed]
    if missing:
        return None, missing
    record = state.read_record() or record  # why again: the parts' checks and runtimes grew since the run began
    audit = audit_parts(state.storage, committed, dict.fromkeys(range(planned)), record)
    for index, why in sorted(audit.bad.items()):
        log.warning("%s: %s; not counted: rerun the shard that owns it", state.storage.describe(committed[index]), why)
    if audit.bad:
        return None, sorted(audit.bad)
    totals = Totals()
    for part_totals in audit.kept.values():
        totals.merge(part_totals)
    started = float(record["run"]["started"])
    manifest = build_manifest(totals, record, started, time.time() - started, totals.output_tokens)
    write_success(state.storage, manifest)
    from batchgen.outputs.openai_batch import write_batch_output  # why here: it imports the job spec

    write_batch_output(state.storage, record)
    return manifest, []


def finalize(out_dir: str | Path, single_writer: bool = False) -> tuple[dict[str, Any], bool]:
    """`batchgen finalize`: (manifest, whether _SUCCESS was already there). Idempotent; on a finished
    output it writes the OpenAI batch output file again when the job asks for one and it is missing.
    `out_dir` may be an object-store URI (options in its query or the store's environment).

    Refuses (IncompleteOutput, exit 8) naming the missing parts when some are not committed.
    """
    storage = open_storage(out_dir, single_writer=single_writer)
    out = storage.where
    if not storage.is_dir():
        raise InputDataError(f"{out}: no such output folder")
    state = OutputState(storage)
    record = state.read_record()
    if record is None:
        raise InputDataError(f"{out}: no {RECORD_NAME}: no batchgen run has started here")
    if "run" not in record:
        raise InputDataError(f"{out}: {RECORD_NAME} was written by an older batchgen; run the job again to finish it")
    lock = OutputLock(storage, shared=True)  # beside shard runs, never beside a plain run
    lock.acquire()
    try:
        if storage.exists(SUCCESS_NAME):
            from batchgen.outputs.openai_batch import write_batch_output  # why here: it imports the job spec

            write_batch_output(storage, record, again=True)  # a deleted OpenAI output file, as a rerun does
            return state.read_success(), True
        manifest, missing = complete_from_parts(state, record)
    finally:
        lock.release()
    if manifest is None:
        shown = ", ".join(part_name(i) for i in missing[:SHOWN_MISSING])
        more = f" and {len(missing) - SHOWN_MISSING} more" if len(missing) > SHOWN_MISSING else ""
        raise IncompleteOutput(
            f"{out}: {len(missing)} of {record['run']['parts']} parts not committed yet: {shown}{more}; "
            "run the shards that own them (part p belongs to shard p % N) or the job without --shard"
        )
    return manifest, False


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {
        "batchgen": batchgen.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "pyarrow": pa.__version__,
        "python": platform.python_version(),
    }
