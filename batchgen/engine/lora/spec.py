"""AdapterSpec: what a PEFT LoRA folder holds, read and checked before any tensor reaches a model.

Why its own module: the job side (`batchgen validate` / `estimate`) and the engine both need the
same answer to "can this adapter run on this model, exactly?", and the job side must get it
without loading weights. `read_adapter` reads `adapter_config.json` and only the header of the
weight file (safetensors) to learn which modules carry LoRA weights and at what rank: the weight
file is the truth about targets, so `target_modules`, `exclude_modules`, `layers_to_transform`
/ `layers_pattern` and `rank_pattern` are honoured as peft applied them when it saved the folder;
`alpha_pattern` and `use_rslora` give each module's scaling. `check_adapter` refuses by name
whatever the engine would not run exactly (DoRA, modules_to_save, embedding or LM-head targets,
trained biases, other PEFT features), never skipping it silently.

The content hash covers the config's bytes and the weight file's bytes: two folders with the same
files hash alike, and an edited adapter hashes anew. It is the adapter's identity in the prefix
cache (core/block_hash) and in a job's fingerprint; a name or an integer id never is.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
# PEFT options that change nothing in an unmerged eval forward, or are applied by the weights saved
_NEUTRAL = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
    "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern", "alpha_pattern",
    "use_rslora", "fan_in_fan_out", "bias", "modules_to_save", "use_dora", "megatron_core",
    "loftq_config", "eva_config", "corda_config", "lora_ga_config", "runtime_config", "qalora_group_size",
    "ensure_weight_tying", "layer_replication", "lora_bias", "use_qalora", "target_parameters",
    "trainable_token_indices", "alora_invocation_tokens", "megatron_config", "velora_config",
    "monteclora_config", "use_bdlora", "arrow_config", "kasa_config",
}  # fmt: skip
# option -> its neutral value(s): anything else is refused by name (check_adapter)
_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "lora_bias": (False, None),
    "layer_replication": (None, []),
    "use_qalora": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, [], {}),
    "alora_invocation_tokens": (None, []),
    "megatron_config": (None, {}),
    "velora_config": (None, {}),
    "monteclora_config": (None, {}),
    "use_bdlora": (None, False, {}),
    "arrow_config": (None, {}),
    "kasa_config": (None, {}),
}

# initialisations that leave the base weights as they are (the others need peft's converted adapter)
_BASE_KEEPING_INITS = ("gaussian", "eva", "orthogonal")


class AdapterRefused(ValueError):
    """An adapter that cannot be read, or cannot run exactly on this model; the message names it."""


@dataclass(frozen=True)
class ModuleLoRA:
    """One targeted module: its path in the model, its rank, scaling, and A/B shapes."""

    module: str  # e.g. "model.layers.0.self_attn.q_proj"
    rank: int
    scaling: float
    in_features: int  # A is [rank, in_features]
    out_features: int  # B is [out_features, rank]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str  # the local folder
    rank: int  # the config's r (the largest per-module rank: max_rank)
    alpha: float
    scaling: float  # alpha / rank, or alpha / sqrt(rank) with use_rslora (the config's r and alpha)
    target_modules: tuple[str, ...]  # the config's target names (a regex string as one item)
    content_hash: bytes
    modules: tuple[ModuleLoRA, ...] = ()  # every module with LoRA weights, from the weight file
    weight_file: str = ""
    use_rslora: bool = False
    options: tuple[tuple[str, str], ...] = ()  # (option, json value) of every non-neutral PEFT option
    unsupported_keys: tuple[str, ...] = ()  # weight keys that are not lora_A/lora_B of a module

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules), default=self.rank)


def read_adapter(name: str, path: str | os.PathLike[str]) -> AdapterSpec:
    """The AdapterSpec of the PEFT folder `path` (no tensor is loaded); AdapterRefused naming the
    adapter and the file when it is missing or unreadable."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterRefused(f"adapter {name!r}: {folder} is not a folder")
    try:
        config_bytes = config_path.read_bytes()
        config = json.loads(config_bytes)
    except (OSError, ValueError) as exc:
        raise AdapterRefused(f"adapter {name!r}: cannot read {config_path}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterRefused(f"adapter {name!r}: {config_path} is not a JSON object")
    weights = next((folder / f for f in WEIGHT_FILES if (folder / f).is_file()), None)
    if weights is None:
        raise AdapterRefused(f"adapter {name!r}: {folder} has none of {', '.join(WEIGHT_FILES)}")
    try:
        digest = hashlib.blake2b(config_bytes, digest_size=32)
        with open(weights, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        shapes = _weight_shapes(weights)
    except Exception as exc:  # why so broad: any failure to read the file is the adapter's
        raise AdapterRefused(f"adapter {name!r}: cannot read {weights}: {exc}") from exc
    return _spec(name, folder, config, config_path, weights, shapes, digest.digest())


def _spec(
    name: str, folder: Path, config: dict[str, Any], config_path: Path, weights: Path,
    shapes: dict[str, tuple[int, ...]], content_hash: bytes,
) -> AdapterSpec:  # fmt: skip
    try:
        rank = int(config.get("r", 8))
        alpha = float(config.get("lora_alpha", 8))
        rslora = bool(config.get("use_rslora", False))
        rank_pattern = dict(config.get("rank_pattern") or {})
        alpha_pattern = dict(config.get("alpha_pattern") or {})
    except (TypeError, ValueError) as exc:
        raise AdapterRefused(f"adapter {name!r}: {config_path}: bad r / lora_alpha / patterns: {exc}") from exc
    if rank < 1:
        raise AdapterRefused(f"adapter {name!r}: {config_path}: r must be >= 1, got {rank}")
    targets = config.get("target_modules") or ()
    target_modules = (targets,) if isinstance(targets, str) else tuple(str(t) for t in targets)
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    unsupported = []
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match is None or len(shape) != 2:
            unsupported.append(key)
            continue
        pairs.setdefault(match["module"], {})[match["which"]] = shape
    modules = []
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"} or ab["A"][0] != ab["B"][1]:
            raise AdapterRefused(f"adapter {name!r}: {weights}: module {module!r} lacks a matching lora_A/lora_B pair")
        r_m = int(rank_pattern.get(_pattern_key(rank_pattern, module), rank))
        alpha_m = float(alpha_pattern.get(_pattern_key(alpha_pattern, module), alpha))
        if r_m != ab["A"][0]:
            raise AdapterRefused(
                f"adapter {name!r}: {weights}: module {module!r} has rank {ab['A'][0]} but {CONFIG_FILE} says {r_m}"
            )
        scaling = alpha_m / math.sqrt(r_m) if rslora else alpha_m / r_m
        modules.append(ModuleLoRA(module, r_m, scaling, ab["A"][1], ab["B"][0]))
    options = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in config.items() if not _neutral_value(k, v)))
    return AdapterSpec(
        name=name,
        path=str(folder),
        rank=rank,
        alpha=alpha,
        scaling=alpha / math.sqrt(rank) if rslora else alpha / rank,
        target_modules=target_modules,
        content_hash=content_hash,
        modules=tuple(modules),
        weight_file=str(weights),
        use_rslora=rslora,
        options=options,
        unsupported_keys=tuple(sorted(unsupported)),
    )


def weight_key(key: str) -> tuple[str, str] | None:
    """(module, "A" or "B") of a PEFT weight key, None for any other key."""
    match = _KEY.match(key)
    return None if match is None else (match["module"], match["which"])


def _pattern_key(pattern: dict[str, Any], module: str) -> str | None:
    """peft's rule: the first pattern key that matches the end of the module's name."""
    return next((k for k in pattern if re.match(rf"(.*\.)?({k})$", module)), None)


def _neutral_value(option: str, value: Any) -> bool:
    if option in _REFUSED_UNLESS:
        return any(value is v or (type(value) is type(v) and value == v) for v in _REFUSED_UNLESS[option])
    if option == "bias":
        return value == "none"
    if option == "init_lora_weights":  # pissa / olora / corda / loftq change the base weights too
        return value is True or value is False or value in _BASE_KEEPING_INITS
    return option in _NEUTRAL


def _weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from a safetensors header (no tensor read) or a .bin (memory-mapped)."""
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return {k: tuple(v.shape) for k, v in state.items()}


def check_adapter(spec: AdapterSpec, hf_config: PretrainedConfig, max_lora_rank: int | None) -> None:
    """AdapterRefused, naming the adapter and the reason, when `spec` cannot run exactly on a model
    of `hf_config` with ranks up to `max_lora_rank` (None: any)."""
    from batchgen.engine.lora.targets import check_modules

    where = f"adapter {spec.name!r} ({spec.path})"
    for option, value in spec.options:  # every option read_adapter did not find neutral
        why = "is not supported" if option in _NEUTRAL else "is a PEFT option batchgen does not know"
        if option == "init_lora_weights":
            why += " (it changes the base weights too: save the adapter converted to plain LoRA)"
        raise AdapterRefused(f"{where}: {option}={value} {why}; only plain LoRA (bias='none') is served")
    if spec.unsupported_keys:
        keys = ", ".join(spec.unsupported_keys[:3])
        raise AdapterRefused(
            f"{where}: weights other than lora_A/lora_B of linear modules are not supported "
            f"(embedding targets, DoRA magnitudes, trained biases): {keys}"
        )
    if not spec.modules:
        raise AdapterRefused(f"{where}: {spec.weight_file} holds no lora_A/lora_B weights")
    if max_lora_rank is not None and spec.max_rank > max_lora_rank:
        raise AdapterRefused(f"{where}: rank {spec.max_rank} is above max_lora_rank {max_lora_rank}")
    problem = check_modules(spec.modules, hf_config)
    if problem is not None:
        raise AdapterRefused(f"{where}: {problem}")
