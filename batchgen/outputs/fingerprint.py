"""A job's fingerprint: what its output depends on (settings, model files, input files), kept in
parts so that a refusal to resume can say what differs.

Input files are keyed by their path relative to the input's root (`InputFile.key`) and identified
by size and content digest (`_file_digest`), never by where they are mounted: the same data reached through
`jobs/../in`, an absolute path or another host's mount point is the same job."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from batchgen.engine.api.params import SamplingParams
from batchgen.inputs.dataset import InputFile
from batchgen.job.adapters import read_adapters
from batchgen.job.spec import JobSpec

_SMALL_FILE = 1 << 20  # model files up to this size are hashed whole; larger ones by size and edges
# Settings that change no generated text: where the output goes and how the engine is tuned.
# (window_rows is not one: it decides which rows form each committed part.)
# (storage_options say how to reach the data, and may hold secrets: never in the record.)
# (model.lora's paths are where the adapters lie: their names and content hashes are the "lora" part.)
_NEUTRAL = {"output": True, "model": {"path", "lora"}, "input": {"path", "storage_options"}}
_NEUTRAL_ENGINE = (
    "batch_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_kv_blocks",
    "kv_cache_memory_mb",
    "enable_prefix_caching",
    "block_size",
    "attention_backend",
    "gpu_memory_utilization",
    "compile",
    "tensor_parallel_size",  # the same tokens on 1 or N ranks (tests/engine/test_tensor_parallel.py)
    # LoRA slots and their padding change no token; which adapters there are is the "lora" part
    "enable_lora",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
)

# Sampling settings added after outputs already existed: left out while at their default, so an
# output made before they existed keeps its fingerprint (and resumes).
_LATER_SAMPLING = (
    "n",
    "logprobs",
    "prompt_logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "bad_words",
    "allowed_token_ids",
    "structured",
)


def job_fingerprint(spec: JobSpec, files: list[InputFile]) -> dict[str, Any]:
    """{"settings": {...}, "model": hex, "inputs": {file key: hex}, "id": hex over all of it}."""
    settings = spec.model_dump(mode="json", exclude=_NEUTRAL)  # type: ignore[arg-type]
    for name in _NEUTRAL_ENGINE:
        settings["engine"].pop(name, None)
    if spec.task == "generate":  # task and pooling came later: a generate output made before keeps its fingerprint
        settings.pop("task", None)
        settings.pop("pooling", None)
    # Later settings, left out at their default so that older outputs keep their fingerprint:
    # input.format (auto reads what older batchgen read), output.reasoning (it shapes the parts).
    if spec.input.format == "auto":
        settings["input"].pop("format", None)
    # input.grouping came later too: at auto (the default) it is left out, and the record's
    # "grouping" key (outputs/plan_file) tells an output made with a prefix plan from an older one.
    if spec.input.grouping == "auto":
        settings["input"].pop("grouping", None)
    if spec.input.group_column is None:
        settings["input"].pop("group_column", None)
    if spec.input.lora_column is None:  # (came later too)
        settings["input"].pop("lora_column", None)
    if spec.output.reasoning != "none":
        settings["output"] = {"reasoning": spec.output.reasoning}
    defaults = SamplingParams()
    for name in _LATER_SAMPLING:
        if getattr(spec.sampling, name) == getattr(defaults, name):
            settings["sampling"].pop(name, None)
    model = hashlib.sha256()
    for path in sorted(p for p in Path(spec.model.path).rglob("*") if p.is_file()):
        model.update(str(path.relative_to(spec.model.path)).encode() + _file_digest(path))
    inputs = {f.key: _input_digest(f).hex() for f in files}
    parts: dict[str, Any] = {"settings": settings, "model": model.hexdigest(), "inputs": inputs}
    if spec.model.lora:  # only then: an output made without adapters keeps its fingerprint
        adapters = read_adapters(spec)
        parts["lora"] = adapters.hashes() if adapters is not None else {}
    parts["id"] = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return parts


def describe_difference(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human lines naming what changed between two fingerprints."""
    lines = [f"{key}: {a!r} -> {b!r}" for key, a, b in _flat_diff(old.get("settings", {}), new["settings"])]
    if old.get("model") != new["model"]:
        lines.append("model files changed")
    lines += _adapter_difference(old.get("lora", {}), new.get("lora", {}))
    old_inputs, new_inputs = old.get("inputs", {}), new["inputs"]
    if any(Path(name).is_absolute() for name in old_inputs):
        # why: keys are relative now; an older record's absolute keys would all read as "no longer present"
        return [*lines, "the record was made by an older batchgen that named input files by absolute path"]
    for name in sorted(set(old_inputs) | set(new_inputs)):
        if name not in new_inputs:
            lines.append(f"input file no longer present: {name} (paths relative to input.path)")
        elif name not in old_inputs:
            lines.append(f"new input file: {name} (paths relative to input.path)")
        elif old_inputs[name] != new_inputs[name]:
            lines.append(f"input file changed (size or content): {name}")
    return lines or ["fingerprint format changed"]


def _adapter_difference(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Lines naming each LoRA adapter (model.lora) added, removed or changed in content."""
    lines = []
    for name in sorted(set(old) | set(new)):
        if name not in new:
            lines.append(f"LoRA adapter no longer in model.lora: {name}")
        elif name not in old:
            lines.append(f"new LoRA adapter in model.lora: {name}")
        elif old[name] != new[name]:
            lines.append(f"LoRA adapter {name} changed (its files' content differs)")
    return lines


def _flat_diff(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(a) | set(b)):
            out += _flat_diff(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [(prefix.rstrip("."), a, b)]


def _input_digest(f: InputFile) -> bytes:
    """An input file's digest, the same for the same bytes on a local disk or an object store."""
    if f.filesystem is None:
        return _file_digest(Path(f.path))
    with f.source() as fh:
        return _stream_digest(fh, fh.size())


def _file_digest(path: Path) -> bytes:
    with path.open("rb") as fh:
        return _stream_digest(fh, path.stat().st_size)


def _stream_digest(fh: Any, size: int) -> bytes:
    """sha256 of the size and the content (or, above _SMALL_FILE, its first and last MiB)."""
    h = hashlib.sha256(str(size).encode())
    if size <= _SMALL_FILE:
        h.update(fh.read())
    else:
        # Why: hashing gigabytes of weights on every run costs more than the check is worth;
        # size plus the first and last MiB catches any real change of checkpoint.
        h.update(fh.read(_SMALL_FILE))
        fh.seek(size - _SMALL_FILE)
        h.update(fh.read(_SMALL_FILE))
    return h.digest()
