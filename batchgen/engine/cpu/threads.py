"""How many threads a CPU engine uses, step by step: what its CPUs can give, not what the machine has.

Why: every OpenMP region waits for its slowest thread, and a thread that lost its core to a busy
neighbour holds each one up (two threads beside two busy processes ran 55x slower than alone; one
thread 1.7x). So every INTERVAL seconds the engine measures how much of its CPUs others took
(/proc/stat) and uses the CPUs left over, at least one. BATCHGEN_ADAPTIVE_THREADS=0 keeps the count.

What that asks of a compiled forward (ThreadedCompile): kernels that read the thread count when
they run, and a check of the traced state that leaves the count out. By default inductor bakes the
compile-time count into every kernel and dynamo guards on it, so a forward compiled while the
governor had lowered the count ran one thread forever, and each new count recompiled it mid-job.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.api.platform import CompilePolicy, StepHook
from batchgen.engine.cpu import host

logger = logging.getLogger(__name__)

DISABLE_ENV = "BATCHGEN_ADAPTIVE_THREADS"  # "0": keep the starting count
INTERVAL = 2.0  # seconds of stepping between two measurements
ROUND_UP = 0.3  # a CPU at least 70% free counts as free (spinning waits make a partly free CPU a loss)


@dataclass(frozen=True)
class Sample:
    """Cumulative times in seconds: wall, the busy time of this process's CPUs, this process's CPU time."""

    wall: float
    busy: float
    own: float


def sample(cpus: set[int] | None = None) -> Sample | None:
    """Now, or None where /proc/stat cannot be read."""
    cpus = cpus if cpus is not None else host.affinity()
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                if not line.startswith("cpu") or line.startswith("cpu "):
                    continue
                name, *fields = line.split()
                if int(name[3:]) in cpus:
                    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
                    busy += sum(values) - values[3] - values[4]
    except (OSError, ValueError):
        return None
    times = os.times()
    return Sample(time.monotonic(), busy / ticks, times.user + times.system)


def threads_for(limit: int, cpus: int, before: Sample, after: Sample) -> int:
    """Threads (1..limit) that fit on the `cpus` CPUs this process may run on, given what other
    processes used of them between two samples. Why both: a Ray worker may use 4 threads of a
    16-CPU node whose other 12 CPUs its fellow workers keep busy; it keeps its 4."""
    wall = after.wall - before.wall
    if wall <= 0:
        return limit
    others = max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall  # in CPUs
    return max(1, min(limit, math.floor(cpus - others + ROUND_UP)))


class ThreadGovernor(StepHook):
    """Sets torch's intra-op threads for a CPU engine from its CPUs' load; `tick()` once per step."""

    def __init__(self, enabled: bool = True) -> None:
        self.cpus = min(torch.get_num_threads(), host.usable_cpus())  # never above what the user or Ray set
        self._affinity = host.affinity()
        self.changes = 0  # how often the count changed (for tests and the log)
        if enabled and torch.get_num_threads() != self.cpus:
            logger.info(
                "CPU threads: %d (affinity %d, cgroup quota %s)", self.cpus, host.affinity_cpus(), host.quota_cpus()
            )
            torch.set_num_threads(self.cpus)
        # None: off (or no /proc/stat), and tick() does nothing
        self._last = sample(self._affinity) if enabled and os.environ.get(DISABLE_ENV) != "0" else None

    def forget(self) -> None:
        """Start the next measurement now: the time since the last one was spent on this process's
        own work in other processes (torch.compile's workers and compilers), which would read as
        busy neighbours and cut the threads for the next INTERVAL."""
        if self._last is not None:
            self._last = sample(self._affinity) or self._last

    def tick(self) -> None:
        if self._last is None or time.monotonic() - self._last.wall < INTERVAL:
            return
        now = sample(self._affinity)
        if now is None:
            return
        wanted = threads_for(self.cpus, len(self._affinity), self._last, now)
        self._last = now
        if wanted != torch.get_num_threads():
            logger.info(
                "CPU threads: %d -> %d (other processes use the rest of %d CPUs)",
                torch.get_num_threads(),
                wanted,
                self.cpus,
            )
            torch.set_num_threads(wanted)
            self.changes += 1


class ThreadedCompile(CompilePolicy):
    """inductor's C++ wrapper and run-time thread counts; dynamo's global-state guard replaced by
    `matches`, which checks the same state less the thread count (dynamo's GlobalStateGuard, its
    count moved to the governor's); another state runs eager."""

    def __init__(self) -> None:
        guards = getattr(torch._C._dynamo, "guards", None)
        # why looked up once: matches() runs every step; None where a build has no such guard
        self._make_guard: Any = getattr(guards, "GlobalStateGuard", None)
        self._guard: Any = None  # dynamo's GlobalStateGuard of the traced state, at _threads threads
        self._threads = 0
        self._warned = False

    def options(self) -> dict[str, Any]:
        """Kernels whose thread count is read when they run, planned for the threads the engine starts with."""
        return {"cpp_wrapper": True, "cpp.dynamic_threads": True, "cpp.threads": torch.get_num_threads()}

    def drops_guard(self, entry: Any) -> bool:
        return bool(entry.guard_type == "GLOBAL_STATE")  # matches() checks it, less the thread count

    def matches(self) -> bool:
        if self._make_guard is None:
            return True
        threads = torch.get_num_threads()
        if self._guard is None:  # the first call: the state it traces under is the one to keep
            self._guard, self._threads = self._make_guard(), threads
        elif threads != self._threads:  # the same state at the governor's new count
            state = json.loads(self._guard.__getstate__())
            state["num_threads"] = threads
            self._guard.__setstate__(json.dumps(state))
            self._threads = threads
        if self._guard.check():
            return True
        if not self._warned:
            self._warned = True
            logger.warning(
                "the compiled forward was traced under other torch settings (%s differs); steps under the "
                "current ones run eager",
                self._guard.reason().strip(),
            )
        return False
