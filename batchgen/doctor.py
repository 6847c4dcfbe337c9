"""`batchgen doctor`: what this machine gives the engine (device, versions, compilers, kernels), and a prebuild.

Why: the native CPU kernels are compiled on the machine that runs them (native.py), and a first
job that finds none pays the build (20 s on an idle 2-core machine, minutes on a busy one) before
its first row, again on every fresh container, Ray node or Airflow worker. `batchgen doctor
--build` builds them once, e.g. in a Dockerfile (`RUN batchgen doctor --build`) or a cluster's
bootstrap, into $BATCHGEN_CACHE_DIR; without --build it only reports, building nothing.
"""

from __future__ import annotations

import subprocess
from importlib import metadata
from typing import Any

import torch
import transformers

from batchgen.engine.cpu import front as attention_front
from batchgen.engine.cpu import host, native, native_linear, native_ops
from batchgen.engine.runner.backends import resolve_backend
from batchgen.engine.runner.dtype_rule import host_rule, resolve_auto


def report(build: bool = False) -> dict[str, Any]:
    """The machine's facts and each kernel's state; with `build`, the missing kernels built first."""
    if build:
        native.load()
        native.argmax()
        attention_front.load()
        native_linear.load_op()  # builds the linear library, then its operator
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": _installed("triton"),
        "attention_backend": resolve_backend("auto", torch.device(device)),
        "dtype_auto": _dtype_auto(device),
        "host": host.describe(),
        "compilers": {"c": _compiler("CC", "cc", "gcc"), "c++": _compiler("CXX", "c++", "g++")},
        "cache_dir": str(native.cache_dir()),
        "native_cflags": " ".join(native.extra_flags()),
        "kernels": [kernel_state(name) for name in native_ops.KERNELS],
    }


def _dtype_auto(device: str) -> str:
    """What model.dtype auto resolves to here, and why (engine/runner/dtype_rule)."""
    if device == "cuda":
        return "CUDA: " + resolve_auto("cuda", None, torch.cuda.is_bf16_supported()).dtype
    return host_rule()


def kernel_state(name: str) -> dict[str, Any]:
    """One kernel's state (native_ops.state) as the report shows it."""
    done = native_ops.state(name)
    return {"name": name, "state": done.state, "path": str(done.path or ""), "why": done.reason}


def _installed(package: str) -> str | None:
    """A package's installed version, read without importing it (importing triton is slow)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _compiler(env: str, *names: str) -> dict[str, str | None]:
    path = native.find_compiler(env, *names)
    if path is None:
        return {"path": None, "version": None}
    try:
        version = native.compiler_version(path).splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        version = None
    return {"path": path, "version": version}


def lines(facts: dict[str, Any]) -> list[str]:
    """The report as the CLI prints it."""
    h = facts["host"]
    flags = ", ".join(flag for flag, present in h["flags"].items() if present) or "none read"
    out = [
        f"device        {facts['device']}{' (' + facts['gpu'] + ')' if facts['gpu'] else ''}",
        f"torch         {facts['torch']} (BLAS: {h['blas']}, CPU capability: {h['torch_cpu_capability']})",
        f"transformers  {facts['transformers']}",
        f"triton        {facts['triton'] or 'not installed'}",
        f"attention     {facts['attention_backend']} (engine.attention_backend: auto)",
        f"dtype auto    {facts['dtype_auto']}",
        f"cpu           {h['cpu']} [{flags}]",
        f"threads       {h['torch_threads']} (affinity {h['affinity_cpus']} CPUs, quota {h['quota_cpus'] or 'none'})",
    ]
    for lang, found in facts["compilers"].items():
        version = f"  {found['version']}" if found["version"] else ""
        out.append(f"{lang + ' compiler':<14}{found['path'] or 'none found'}{version}")
    out.append(f"kernel cache  {facts['cache_dir']}")
    if facts["native_cflags"]:
        out.append(f"extra cflags  {facts['native_cflags']} ({native.FLAGS_ENV})")
    for k in facts["kernels"]:
        detail = k["why"] or k["path"]
        out.append(f"  {k['name']:<24}{k['state']}{'  ' + detail if detail else ''}")
    return out
