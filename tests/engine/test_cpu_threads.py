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


def test_forgetting_a_window_of_our_own_compiling_keeps_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile's workers are other processes: a window that held a compile would read as busy
    neighbours. After forget() the next tick measures only what came after. The CPU counters are
    scripted (two CPUs busy for the first second, then quiet) so that the machine's own load cannot
    decide the outcome; test_busy_neighbours_... reads real ones."""
    if host.usable_cpus() < 2:
        pytest.skip("needs two CPUs")
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "INTERVAL", 0.5)
    start = time.monotonic() - 5.0  # every scripted window is already over by INTERVAL
    counters = {"wall": 0.0, "busy": 0.0}

    def scripted(cpus: set[int] | None = None) -> Sample:
        return Sample(start + counters["wall"], counters["busy"], 0.0)

    monkeypatch.setattr(cpu_threads, "sample", scripted)
    forgetful, plain = ThreadGovernor(), ThreadGovernor()
    counters.update(wall=1.0, busy=2.0)  # the compile: two CPUs busy for a second
    forgetful.forget()
    counters.update(wall=1.6)  # then 0.6 s with nothing else running
    forgetful.tick()
    assert forgetful.changes == 0 and torch.get_num_threads() == forgetful.cpus == 2
    plain.tick()  # the control: its window still holds the busy second
    assert plain.changes == 1 and torch.get_num_threads() == 1
