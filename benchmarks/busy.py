"""Busy neighbours for a contended benchmark: one pure-Python spinning process per core, as on a
shared Airflow worker, a Ray node with other actors, or a CI box.

    with busy_neighbours(2):
        ...  # the measured run
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager

from batchgen.engine.cpu import host


def _spin() -> None:  # pragma: no cover - runs in the neighbour processes
    while True:
        sum(i * i for i in range(10_000))


@contextmanager
def busy_neighbours(count: int | None = None) -> Iterator[int]:
    """`count` spinning processes (default: one per CPU this process may use) for the duration."""
    count = count if count is not None else host.affinity_cpus()
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=_spin, daemon=True) for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        yield count
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.join()
