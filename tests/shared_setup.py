"""Expensive test setup done once per test run, even when pytest-xdist spreads its users over workers.

Why: a session- or module-scoped fixture is per process, and `make test` runs two worker processes
that take tests in chunks, so the users of one fixture can land on both and each would pay it (a
kernel build, the GPU check's smoke run: tens of seconds). Here the first worker to ask does the
work in a folder that every worker of the run sees (xdist's own recipe: the parent of the
workers' temporary folders), under a file lock; the others wait for it and take the result. A
setup that failed is not recorded as done: the next one to ask retries it (and fails alike).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of this test run shared by its xdist workers (this process's own without xdist:
    xdist names each worker in PYTEST_XDIST_WORKER)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory: pytest.TempPathFactory, name: str, setup: Callable[[Path], None]) -> Path:
    """Folder `name` of this run, made by `setup(folder)` the first time any worker asks for it."""
    root = run_folder(tmp_path_factory)
    folder = root / name
    done = root / f"{name}.done"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            folder.mkdir(exist_ok=True)
            setup(folder)
            done.touch()
    return folder
