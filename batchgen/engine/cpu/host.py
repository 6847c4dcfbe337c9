"""What this CPU host is (model, vector units, BLAS) and how many threads a process may really use.

Every benchmark JSON and `batchgen doctor` record these facts; the thread count comes from `usable_cpus`.
"""

from __future__ import annotations

import math
import os
import platform
import re
from pathlib import Path
from typing import Any

import torch

from batchgen.engine.api.dtype_rule import cpu_flag_set

VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "asimd", "sve")  # the ones our figures depend on
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "quota period" or "max period"
CGROUP_V1_QUOTA = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
CGROUP_V1_PERIOD = Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def cpu_model() -> str:
    for line in cpuinfo_lines():
        if line.startswith(("model name", "Model name")):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> dict[str, bool]:
    """Whether the CPU has each of VECTOR_FLAGS, as the dtype rule reads them (all False where they cannot be read)."""
    present, _ = cpu_flag_set()
    return {flag: flag in present for flag in VECTOR_FLAGS}


def blas() -> str:
    """The BLAS torch's float32 linears use on the CPU, as torch's build says (e.g. "mkl", "openblas")."""
    found = re.search(r"BLAS_INFO=([\w.-]+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


def affinity() -> set[int]:
    """The CPUs this process may be scheduled on (its affinity mask), or every CPU where there is no mask."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def affinity_cpus() -> int:
    return len(affinity())


def quota_cpus() -> float | None:
    """The cgroup CPU quota in CPUs (a container's --cpus), None where there is none."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(CGROUP_V1_QUOTA.read_text())
        return None if quota_us <= 0 else quota_us / int(CGROUP_V1_PERIOD.read_text())
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process can really run on at once: its affinity mask, capped by its cgroup quota
    (rounded up; a quota of 0.5 CPU is still one thread)."""
    quota = quota_cpus()
    cpus = affinity_cpus()
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def describe() -> dict[str, Any]:
    """The facts a benchmark or `batchgen doctor` records: CPU, its vector units, BLAS, threads."""
    return {
        "cpu": cpu_model(),
        "machine": platform.machine(),
        "flags": cpu_flags(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": blas(),
        "affinity_cpus": affinity_cpus(),
        "quota_cpus": quota_cpus(),
        "torch_threads": torch.get_num_threads(),
    }


def cpuinfo_lines() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return text.split("\n\n", 1)[0].splitlines()  # the first CPU describes them all
