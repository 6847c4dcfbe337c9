"""`batchgen doctor`: what this machine gives the engine (device, versions, compilers, kernels), and a prebuild.

Why: the native CPU kernels are compiled on the machine that runs them (native.py), and a first
job that finds none pays the build (20 s to 2 minutes on an idle 2-core machine, more on a busy one) before
its first row, again on every fresh container, Ray node or Airflow worker. `batchgen doctor
--build` builds them once, e.g. in a Dockerfile (`RUN batchgen doctor --build`) or a cluster's
bootstrap, into $BATCHGEN_CACHE_DIR; without --build it only reports, building nothing.

It also lists the choices measured on this machine and kept for good (which linear kernel, decode
attention path and argmax each shape takes: engine/cpu/choice_cache.py): one measured in a busy
spell stays until `batchgen doctor --remeasure` forgets them all.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

import torch
import transformers

from batchgen.engine.api.dtype_rule import host_rule, resolve_auto
from batchgen.engine.platforms import platform_for
from batchgen.errors import BatchgenError


def report(build: bool = False) -> dict[str, Any]:
    """The machine's facts and each kernel's state; with `build`, the missing kernels built first.

    The CPU's facts (host, compilers, native kernels) come on every machine: a CUDA box runs CPU
    engines too (a tensor-parallel gloo test, `device: cpu` jobs)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": _installed("triton"),
        "attention_backend": platform_for(device).attention_backend("auto"),
        "dtype_auto": _dtype_auto(device),
        **platform_for("cpu").facts(build),
    }


def forget_measured() -> str:
    """Forget the measured choices (--remeasure); what to tell the user."""
    try:
        gone = platform_for("cpu").forget_measured()
    except OSError as exc:  # a cache another user owns, a read-only mount
        raise BatchgenError(f"--remeasure: cannot remove {exc.filename}: {exc.strerror}") from exc
    return f"batchgen: forgot {gone} measured choices: the next engine on this machine measures its shapes again"


def _dtype_auto(device: str) -> str:
    """What model.dtype auto resolves to here, and why (engine/api/dtype_rule)."""
    if device == "cuda":
        return "CUDA: " + resolve_auto("cuda", None, torch.cuda.is_bf16_supported()).dtype
    return host_rule()


def _installed(package: str) -> str | None:
    """A package's installed version, read without importing it (importing triton is slow)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


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
        out.append(f"extra cflags  {facts['native_cflags']} ({facts['native_cflags_env']})")
    for k in facts["kernels"]:
        detail = k["why"] or k["path"]
        out.append(f"  {k['name']:<24}{k['state']}{'  ' + detail if detail else ''}")
    return [*out, _measured_line(facts["measured_choices"])]


def _measured_line(choices: dict[str, dict[str, Any]]) -> str:
    """The stored choices in one line: how many of each kind, and when they were measured."""
    if not choices:
        return "measured      nothing yet (an engine measures its model's shapes once, then keeps the choice)"
    counts = ", ".join(f"{folder} {c['count']}" for folder, c in choices.items())
    oldest = min(c["oldest"] for c in choices.values())
    newest = max(c["newest"] for c in choices.values())
    return f"measured      {counts} ({oldest} to {newest} UTC; --remeasure forgets them)"
