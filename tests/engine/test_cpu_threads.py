"""The CPU engine's thread count follows what other processes leave of its CPUs (cpu_threads)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch

from batchgen.engine.cpu import host
from batchgen.engine.cpu import threads as cpu_threads
from batchgen.engine.cpu.threads import Sample, ThreadGovernor, threads_for
from benchmarks.busy import busy_neighbours


@pytest.fixture(autouse=True)
def _keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _window(others: float, own: float = 1.0, wall: float = 2.0) -> tuple[Sample, Sample]:
    """Two samples `wall` seconds apart in which other processes used `others` CPUs on average."""
    return Sample(0.0, 0.0, 0.0), Sample(wall, (others + own) * wall, own * wall)


@pytest.mark.parametrize(
    ("limit", "cpus", "others", "threads"),
    [
        (2, 2, 0.0, 2),  # a quiet machine: every CPU
        (2, 2, 0.2, 2),  # a little noise: still every CPU
        (2, 2, 0.9, 1),  # one busy neighbour on two CPUs
        (2, 2, 2.0, 1),  # two: never fewer than one thread
        (16, 16, 5.0, 11),
        (4, 16, 12.0, 4),  # a Ray worker of 4 threads beside three others on a 16-CPU node keeps its 4
        (4, 16, 13.5, 2),
    ],
)
def test_threads_are_the_cpus_other_processes_leave(limit: int, cpus: int, others: float, threads: int) -> None:
    assert threads_for(limit, cpus, *_window(others)) == threads


@pytest.mark.serial
def test_busy_neighbours_take_threads_away_and_the_count_is_within_the_processes_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real processes spinning on every CPU of this one: the next tick drops to one thread."""
    if cpu_threads.sample() is None:
        pytest.skip("no /proc/stat: the governor keeps its starting count there")
    torch.set_num_threads(host.usable_cpus())
    monkeypatch.setattr(cpu_threads, "INTERVAL", 0.5)
    governor = ThreadGovernor()
    assert governor.cpus == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    with busy_neighbours():
        time.sleep(0.3)  # the neighbours are up
        governor._last = cpu_threads.sample()
        time.sleep(1.0)
        governor.tick()
    assert torch.get_num_threads() == 1
    assert governor.changes == (1 if governor.cpus > 1 else 0)


def test_a_governor_that_is_off_never_changes_the_count() -> None:
    torch.set_num_threads(1)
    governor = ThreadGovernor(enabled=False)
    governor.tick()
    assert governor._last is None and torch.get_num_threads() == 1


@pytest.mark.serial
def test_forgetting_a_window_of_our_own_compiling_keeps_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile's workers are other processes: a window that held a compile would read as busy
    neighbours. After forget() the next tick measures only what came after."""
    if cpu_threads.sample() is None or host.usable_cpus() < 2:
        pytest.skip("needs /proc/stat and two CPUs")
    torch.set_num_threads(host.usable_cpus())
    monkeypatch.setattr(cpu_threads, "INTERVAL", 0.5)
    forgetful, plain = ThreadGovernor(), ThreadGovernor()
    with busy_neighbours():  # stand-ins for the compile workers
        time.sleep(1.0)
    forgetful.forget()
    time.sleep(0.6)
    forgetful.tick()
    assert forgetful.changes == 0 and torch.get_num_threads() == forgetful.cpus
    plain.tick()  # the control: its window still holds the busy second
    assert plain.changes == 1 and torch.get_num_threads() < plain.cpus
