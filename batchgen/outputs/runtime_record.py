"""Which resolved runtime (device type, dtype, attention backend: what the backend resolves) generated
an output's parts, kept in the job record (`_JOB.json`, key `runtimes`), and the refusal to mix.

Why: the job file may say `device: auto` and `dtype: auto`, which the fingerprint keeps as written;
a job started on a CPU in float32 could resume on a GPU in bfloat16 and its parts would disagree
silently. Each process claims its runtime in the record before generating (compare-and-swap, so
two shards starting at once on different machines cannot both win); a different one is refused
(exit 2, as a changed job) unless the run allows it, and the `_SUCCESS` manifest then lists every
runtime that made parts.

The description comes from `Backend.resolved()`: a flat dict of names to strings. Two descriptions
differ when a name they share has different values; a name only one has (the attention backend in
a record made before it was recorded) is no difference, and is added to the record's entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchgen.errors import FingerprintMismatch
from batchgen.outputs.record import update_record
from batchgen.storage.base import Storage

RUNTIMES_KEY = "runtimes"
ALLOW_FLAG = "--allow-precision-change"


def same_runtime(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def describe_runtime(runtime: Mapping[str, str]) -> str:
    """ "cpu, float32" (names sorted after device and dtype, so the line reads the same every time)."""
    order = ["device", "dtype", *sorted(set(runtime) - {"device", "dtype"})]
    return ", ".join(runtime[k] if k in ("device", "dtype") else f"{k} {runtime[k]}" for k in order if k in runtime)


def claim_runtime(storage: Storage, resolved: Mapping[str, str], allow_change: bool) -> int:
    """The index of `resolved` in the record's runtimes, added if new. FingerprintMismatch when
    the output's parts were made by another runtime and `allow_change` is False."""
    found: list[int] = []

    def claim(record: dict[str, Any]) -> dict[str, Any] | None:
        seen: list[dict[str, str]] = list(record.get(RUNTIMES_KEY, []))
        others = [r for r in seen if not same_runtime(r, resolved)]
        if others and not allow_change:
            raise FingerprintMismatch(_refusal(storage, others, resolved))
        index = next((i for i, r in enumerate(seen) if same_runtime(r, resolved)), len(seen))
        found[:] = [index]
        merged = {**resolved, **seen[index]} if index < len(seen) else dict(resolved)
        if index < len(seen) and merged == seen[index]:
            return None
        seen[index : index + 1] = [merged]
        return {**record, RUNTIMES_KEY: seen}

    update_record(storage, claim, "runtime_record_write")
    return found[0]


def _refusal(storage: Storage, others: list[dict[str, str]], resolved: Mapping[str, str]) -> str:
    made = "; ".join(describe_runtime(r) for r in others)
    return (
        f"{storage.where}: its parts were generated on {made}, and this run resolves to {describe_runtime(resolved)}: "
        "parts of one output made on different devices, precisions or attention backends differ silently. Run it "
        "where model.device, model.dtype and engine.attention_backend resolve the same (or set them explicitly), "
        f"start again with --overwrite, or accept mixed parts with {ALLOW_FLAG} (the _SUCCESS manifest then "
        "lists every runtime). On a mixed fleet (CPUs with and without native bf16, GPUs), `model.dtype: float32` "
        "pins one precision wherever the job runs"
    )


def recorded_dtype(record: Mapping[str, Any]) -> str | None:
    """The one dtype every runtime in the record made parts in (None: no runtime yet, or several).
    Why: `dtype: auto` on a resumed output resolves to it, so a host or batchgen upgrade that would
    resolve auto differently never strands a half-done output (the runner pins it)."""
    dtypes = {r.get("dtype") for r in record.get(RUNTIMES_KEY, [])}
    return dtypes.pop() if len(dtypes) == 1 and None not in dtypes else None


def manifest_runtimes(record: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's account: `runtimes` (every runtime that claimed this output, first first) and,
    when there are several, `precision_changed: true` (allowed by ALLOW_FLAG)."""
    runtimes = list(record.get(RUNTIMES_KEY, []))
    return {RUNTIMES_KEY: runtimes, **({"precision_changed": True} if len(runtimes) > 1 else {})}
