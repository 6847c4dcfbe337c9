"""What `dtype: auto` resolves to on this host, and why: the one rule every backend, the pooling
tasks, `validate`, `estimate` and `batchgen doctor` ask.

Deterministic (CPU flags and the checkpoint's stored dtype, never a timing): CUDA bfloat16 where
supported, else float16; CPU bfloat16 when the checkpoint is stored in bf16/fp16 AND the CPU has a
native bf16 flag (AMX-BF16, AVX512-BF16), else float32. BATCHGEN_CPU_FLAGS overrides /proc/cpuinfo.
No torch import at module level (`validate` asks early).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

FLAGS_ENV = "BATCHGEN_CPU_FLAGS"
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # Linux's names for the CPU's bf16 dot-product units
REDUCED = ("bfloat16", "float16")
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
_CONFIG_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32"}


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype name ("float32" | "bfloat16" | "float16") and the reason, as logs print it."""

    dtype: str
    why: str

    def line(self, setting: str) -> str:
        """ "dtype auto -> bfloat16 (...)" or "dtype float32 (set in the job)"."""
        shown = f"{setting} -> {self.dtype}" if setting == "auto" else self.dtype
        return f"dtype {shown} ({self.why})"


def cpu_flag_set() -> tuple[set[str], str]:
    """The CPU's flags and where they were read: BATCHGEN_CPU_FLAGS when set, else /proc/cpuinfo."""
    stated = os.environ.get(FLAGS_ENV)
    if stated is not None:
        return set(stated.replace(",", " ").split()), FLAGS_ENV
    try:
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]  # the first CPU describes them all
    except OSError:
        return set(), "/proc/cpuinfo (unreadable)"
    for line in first_cpu.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split()), "/proc/cpuinfo"
    return set(), "/proc/cpuinfo (no flags line)"


def native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively, and the flags that say so (or their absence)."""
    flags, source = cpu_flag_set()
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if found:
        return True, f"{'+'.join(found)} in {source}"
    return False, f"no {' or '.join(NATIVE_BF16_FLAGS)} in {source}"


def checkpoint_dtype(model_path: str | os.PathLike[str]) -> tuple[str | None, str]:
    """The dtype a checkpoint is stored in and where that was read: its config.json's `dtype` /
    `torch_dtype`, else the floating tensors of its (first) safetensors file. (None, why) if neither says."""
    folder = Path(model_path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("dtype", "torch_dtype"):
            name = _CONFIG_DTYPES.get(str(source.get(key)).removeprefix("torch."))
            if name is not None:
                return name, f"config.json {key}"
    return _safetensors_dtype(folder) or (None, "neither config.json nor a safetensors header names it")


def _safetensors_dtype(folder: Path) -> tuple[str, str] | None:
    """The most common floating dtype in the first safetensors file's header (8-byte length, then JSON)."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    try:
        with files[0].open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(min(length, 100_000_000)))
    except (OSError, ValueError, struct.error):
        return None
    counts: dict[str, int] = {}
    for name, entry in header.items():
        kind = _SAFETENSORS_DTYPES.get(entry.get("dtype", "")) if name != "__metadata__" else None
        if kind is not None:
            counts[kind] = counts.get(kind, 0) + 1
    if not counts:
        return None
    return max(counts, key=lambda k: counts[k]), f"{files[0].name} header"


def resolve_auto(device_type: str, model_path: str | os.PathLike[str] | None, cuda_bf16: bool = False) -> DtypeChoice:
    """What `dtype: auto` is on `device_type` for the checkpoint at `model_path` (None: not known)."""
    if device_type == "cuda":
        if cuda_bf16:
            return DtypeChoice("bfloat16", "CUDA with bf16 support")
        return DtypeChoice("float16", "CUDA without bf16 support")
    if device_type != "cpu":
        return DtypeChoice("float32", f"{device_type}: float32 for exactness")
    if model_path is None:
        return DtypeChoice("float32", "no checkpoint to read its dtype from")
    stored, where = checkpoint_dtype(model_path)
    if stored not in REDUCED:
        return DtypeChoice("float32", f"checkpoint stored in {stored or 'an unknown dtype'} ({where})")
    native, flags = native_bf16()
    if not native:
        return DtypeChoice("float32", f"checkpoint stored in {stored} ({where}), but the CPU has {flags}")
    return DtypeChoice("bfloat16", f"checkpoint stored in {stored} ({where}) and native bf16 on this CPU: {flags}")


def for_job(setting: str, device_setting: str, model_path: str | os.PathLike[str] | None) -> DtypeChoice:
    """What a job's model.dtype or LLM's dtype ("auto" or a name) resolves to on its device ("auto":
    CUDA when present, else the CPU), with its reason. torch is imported only where CUDA must be asked."""
    if setting != "auto":
        if setting not in DTYPE_NAMES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {setting!r}")
        return DtypeChoice(setting, "set explicitly")
    if device_setting == "cpu":
        return resolve_auto("cpu", model_path)
    import torch  # why here: `validate` and `estimate` of a CPU job need no torch

    cuda = torch.cuda.is_available()
    device_type = ("cuda" if cuda else "cpu") if device_setting == "auto" else device_setting.split(":")[0]
    return resolve_auto(device_type, model_path, device_type == "cuda" and cuda and torch.cuda.is_bf16_supported())


def host_rule() -> str:
    """What auto resolves to on this host's CPU, for `batchgen doctor` (no checkpoint at hand)."""
    native, flags = native_bf16()
    if native:
        return f"CPU: bfloat16 for checkpoints stored in bf16/fp16, float32 for float32 ones ({flags})"
    return f"CPU: float32 ({flags}; bf16 would be emulated)"
