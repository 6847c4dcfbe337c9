"""Whether a finished output's `_SUCCESS` agrees with its committed parts (`batchgen report`'s
cross-check), and what the job record says about the output's adapter column."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchgen.outputs.adapter_field import record_has_adapters
from batchgen.outputs.record import RECORD_NAME
from batchgen.outputs.runtime_record import describe_runtime
from batchgen.outputs.state import SUCCESS_NAME
from batchgen.outputs.totals import Totals
from batchgen.storage.base import Storage


@dataclass
class OutputStatus:
    """Whether the run is finished, and whether its `_SUCCESS` agrees with the parts."""

    parts: int
    finished: bool
    mismatches: list[str] = field(default_factory=list)
    mixed_runtimes: list[str] = field(default_factory=list)  # several, allowed by --allow-precision-change

    def line(self) -> str:
        if not self.finished:
            return f"in progress: {self.parts} parts committed, no _SUCCESS"
        mixed = f"; parts from several runtimes: {'; '.join(self.mixed_runtimes)}" if self.mixed_runtimes else ""
        if self.mismatches:
            return f"finished, but the parts DISAGREE with _SUCCESS: {'; '.join(self.mismatches)}{mixed}"
        return f"finished: {self.parts} parts, totals match _SUCCESS{mixed}"


def job_has_adapters(storage: Storage) -> bool:
    """Whether the job record (without one: `_SUCCESS`) says the job had LoRA adapters: the release
    before adapter_field's mark wrote its adapter column unmarked."""
    for name in (RECORD_NAME, SUCCESS_NAME):
        try:
            text = storage.read_text(name)
            if text is not None:
                found = json.loads(text)
                return isinstance(found, dict) and record_has_adapters(found)  # (_SUCCESS: the same key)
        except (OSError, ValueError):
            continue  # an unreadable _SUCCESS is output_status's to report
    return False


def output_status(storage: Storage, num_parts: int, totals: Totals, adapters: bool = False) -> OutputStatus:
    """`adapters`: the output has batchgen's adapter column (only then are per-adapter totals checked)."""
    success = storage.describe(SUCCESS_NAME)
    try:
        text = storage.read_text(SUCCESS_NAME)
        if text is None:
            return OutputStatus(parts=num_parts, finished=False)
        manifest = json.loads(text)
    except (OSError, ValueError) as exc:
        return OutputStatus(parts=num_parts, finished=True, mismatches=[f"cannot read {success}: {exc}"])
    mixed = [describe_runtime(r) for r in manifest.get("runtimes", [])] if manifest.get("precision_changed") else []
    return OutputStatus(num_parts, True, _mismatches(manifest, num_parts, totals, adapters), mixed)


def _mismatches(manifest: dict[str, Any], num_parts: int, totals: Totals, adapters: bool) -> list[str]:
    """Each figure of `_SUCCESS` that the committed parts do not reproduce."""
    rows, tokens = manifest.get("rows") or {}, manifest.get("tokens") or {}
    expected: list[tuple[str, Any, Any]] = [
        ("rows.total", rows.get("total"), totals.rows),
        ("rows.ok", rows.get("ok"), totals.ok_rows),
        ("rows.error", rows.get("error"), totals.error_rows),
        ("tokens.input", tokens.get("input"), totals.input_tokens),
        ("tokens.cached", tokens.get("cached"), totals.cached_tokens),
        ("tokens.output", tokens.get("output"), totals.output_tokens),
        ("tokens.reasoning", tokens.get("reasoning", 0), totals.reasoning_tokens),
        ("parts", manifest.get("parts"), num_parts),
        ("error_codes", manifest.get("error_codes"), totals.error_codes),
        ("finish_reasons", manifest.get("finish_reasons"), totals.finish_reasons),
    ]
    if adapters:  # a job with LoRA adapters: rows and tokens per adapter (none at all: no rows)
        # why not by "lora" in the manifest: an older batchgen counted a user's `lora` column there too
        expected.append(("lora", manifest.get("lora", {}), totals.by_lora))
    return [f"{name}: _SUCCESS says {said}, the parts hold {held}" for name, said, held in expected if said != held]
