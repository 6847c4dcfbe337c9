"""The job's LoRA adapters (`model.lora`): each folder found (an object-store one fetched to a local
cache: job/adapter_fetch), read, and checked against the model before any work; the engine settings they imply
(`engine.max_loras`, `engine.max_lora_rank` defaults) and the request each row's adapter becomes.

Why here, on the job side: the engine reads and checks one adapter (engine/lora/spec); which
adapters a job has, where their folders are, which key a problem is reported at and with which exit
code (README "Exit codes": a job value the adapters cannot take is 2, an adapter folder that cannot
serve is 4, like the model folder's) are the job's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchgen.errors import JobFileError, ModelError
from batchgen.job.adapter_fetch import ADAPTER_FILES, fetch_adapter
from batchgen.job.lora_keys import MAX_DEFAULT_LORAS
from batchgen.job.spec import JobSpec
from batchgen.storage.uris import display_uri, is_remote


@dataclass(frozen=True)
class JobAdapters:
    """The job's adapters, read: name -> AdapterSpec (in model.lora's order), and the engine's
    adapter settings (the job's, or their defaults from the adapters)."""

    specs: dict[str, Any]  # name -> batchgen.engine.lora.spec.AdapterSpec
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None

    def hashes(self) -> dict[str, str]:
        """name -> the adapter's content hash (hex): what the fingerprint and the prefix plan key by."""
        return {name: s.content_hash.hex() for name, s in self.specs.items()}

    def engine_settings(self) -> dict[str, Any]:
        """The adapter keywords of LLM(...) / EngineConfig(...)."""
        return {
            "enable_lora": True,
            "max_loras": self.max_loras,
            "max_lora_rank": self.max_lora_rank,
            "max_cpu_loras": self.max_cpu_loras,
        }

    def requests(self) -> dict[str, Any]:
        """name -> the LoRARequest every row naming it is served with (ids 1.. in model.lora's order)."""
        from batchgen.engine.api.lora_request import LoRARequest

        return {name: LoRARequest(name, i + 1, str(s.path)) for i, (name, s) in enumerate(self.specs.items())}


_READ: dict[tuple[str, str], tuple[tuple[Any, ...], Any]] = {}  # (name, path) -> (file stamps, spec)


def read_adapters(spec: JobSpec) -> JobAdapters | None:
    """The job's adapters, read from their folders (None: the job has none). A missing or
    unreadable folder is a ModelError naming the key and the path."""
    if not spec.model.lora:
        return None
    specs = {name: _read_one(name, path) for name, path in spec.model.lora.items()}
    engine = spec.engine
    chosen = engine.model_fields_set
    largest = max(s.max_rank for s in specs.values())
    max_loras = engine.max_loras if "max_loras" in chosen else min(len(specs), MAX_DEFAULT_LORAS)
    max_rank = engine.max_lora_rank if "max_lora_rank" in chosen else largest
    cpu = engine.max_cpu_loras if "max_cpu_loras" in chosen else None
    return JobAdapters(specs, max_loras, max_rank, cpu)


def check_adapters(spec: JobSpec, config: Any) -> JobAdapters | None:
    """Every adapter of the job against the model's config and engine.max_lora_rank, before any
    work: a rank above a max_lora_rank the job sets is a job value (exit 2, naming the key); an
    adapter the engine cannot serve (targets the model lacks, DoRA, modules_to_save, embedding
    targets, unsupported PEFT options) is refused by name (exit 4)."""
    adapters = read_adapters(spec)
    if adapters is None:
        return None
    cpu = adapters.max_cpu_loras
    if cpu is not None and cpu < adapters.max_loras:
        raise JobFileError(
            f"{spec.where('engine.max_cpu_loras')}: engine.max_cpu_loras {cpu} is below engine.max_loras "
            f"{adapters.max_loras} (the adapters resident on the device are kept in host memory too)"
        )
    from batchgen.engine.lora.spec import AdapterRefused, check_adapter  # why here: jobs without adapters skip it

    for name, one in adapters.specs.items():
        if one.max_rank > adapters.max_lora_rank:
            where = spec.where("engine.max_lora_rank")
            raise JobFileError(
                f"{where}: engine.max_lora_rank {adapters.max_lora_rank} is below adapter {name!r}'s rank "
                f"{one.max_rank} (model.lora.{name} {display_uri(spec.model.lora[name])}); raise it or leave it unset"
            )
        try:
            check_adapter(one, config, adapters.max_lora_rank)
        except AdapterRefused as exc:
            raise ModelError(f"model.lora.{name} {display_uri(spec.model.lora[name])}: {exc}") from None
    return adapters


def adapter_lines(spec: JobSpec) -> list[str]:
    """A line per adapter for `validate`: its rank, modules and folder, then the engine settings."""
    adapters = read_adapters(spec)
    if adapters is None:
        return []
    lines = [
        f"model.lora.{name}: rank {s.max_rank}, {len(s.modules)} modules, {display_uri(spec.model.lora[name])}"
        for name, s in adapters.specs.items()
    ]
    return [*lines, f"engine.max_loras {adapters.max_loras}, engine.max_lora_rank {adapters.max_lora_rank}"]


def _read_one(name: str, path: str) -> Any:
    from batchgen.engine.lora.spec import AdapterRefused, read_adapter

    where = f"model.lora.{name} {display_uri(path)}"
    folder = fetch_adapter(name, path) if is_remote(path) else Path(path)
    if not folder.is_dir():
        raise ModelError(f"{where}: no such folder (a PEFT adapter folder: adapter_config.json and its weights)")
    stamps = _stamps(folder)
    known = _READ.get((name, str(folder)))
    if known is not None and known[0] == stamps:  # why: validate, fingerprint and load each ask; read once
        return known[1]
    try:
        one = read_adapter(name, folder)
    except (AdapterRefused, OSError, ValueError) as exc:
        raise ModelError(f"{where}: {exc}") from None
    _READ[(name, str(folder))] = (stamps, one)
    return one


def _stamps(folder: Path) -> tuple[Any, ...]:
    """The adapter files' sizes and modification times: a changed file is read again."""
    out = []
    for file in ADAPTER_FILES:
        try:
            st = (folder / file).stat()
        except OSError:
            continue
        out.append((file, st.st_size, st.st_mtime_ns))
    return tuple(out)
