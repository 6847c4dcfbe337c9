"""Named fault points: places where a run can be made to die, fail or pause on purpose.

Why a production module: the crash-safety tests stop a run at these exact lines, and an operator
can too (rehearsing a kill -9 mid-part, a full disk, a dead store before trusting resume).

Set BATCHGEN_FAULT=<point> (or <point>:<n> to fire on the n-th pass) in a test's subprocess.
`kill` points SIGKILL the process, exactly like the OOM killer would (BATCHGEN_FAULT_SIGNAL=SIGTERM
or SIGINT sends that signal instead, as a scheduler or Ctrl-C would, at that exact line); `raise`
points raise an exception, like a failing engine; `disk_full` raises OSError(ENOSPC) on the n-th
local atomic write (a part, the record or `_SUCCESS`), after its temp file holds the data, as a
file system that fills up mid-write would; `store_unavailable` raises the error of an object store
whose retries were spent, as a Ray worker starts a part. Unset, every point is two environment lookups.

BATCHGEN_FAULT_PAUSE=<folder> makes any point a pause instead: the first process to reach it
writes its pid to `<folder>/<point>.paused` and waits there until `<folder>/<point>.resume` exists.
Why: a test that acts from outside (a signal, kill -9 of a Ray worker) at a known moment cannot
race the run (which would otherwise finish first on a loaded machine). Other processes reaching the
point go on, so a replacement worker is not paused again.

BATCHGEN_FAULT_FILE=<file> reads these settings from the file's `NAME=value` lines at each point
instead of the environment, for processes started before the test knows its fault (Ray workers);
while the file is missing, the environment's settings hold.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path

_KILL_POINTS = {
    "after_temp_write",
    "after_rename",
    "before_success",
    "mid_engine",
    "record_temp_write",
    "part_record_write",
    "runtime_record_write",
    "success_temp_write",
    "lease_write",
    "plan_temp_write",  # the part plan (outputs/plan_file), written but not yet committed
    "tp_rank_step",  # a tensor-parallel worker (rank >= 1), before it runs a step
}
_RAISE_POINTS = {"engine_exception"}
PAUSE_SECONDS = 600.0  # a paused process nobody resumes fails rather than hanging a test run forever
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    settings = _settings()
    spec = settings.get("BATCHGEN_FAULT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(nth or 1):
        return
    if settings.get("BATCHGEN_FAULT_PAUSE"):
        _pause(Path(settings["BATCHGEN_FAULT_PAUSE"]), name)
        return
    if name in _KILL_POINTS:
        os.kill(os.getpid(), signal.Signals[settings.get("BATCHGEN_FAULT_SIGNAL", "SIGKILL")])
    if name == "disk_full":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected fault)")
    if name == "store_unavailable":
        from batchgen.errors import StoreUnavailable

        raise StoreUnavailable("injected fault store_unavailable: the store's retries were spent")
    if name in _RAISE_POINTS:
        raise RuntimeError(f"injected fault {name}: simulated engine failure (e.g. NaN logits)")


def _settings() -> Mapping[str, str]:
    source = os.environ.get("BATCHGEN_FAULT_FILE")
    if not source:
        return os.environ
    try:
        lines = Path(source).read_text().splitlines()
    except FileNotFoundError:
        return os.environ
    return dict(line.split("=", 1) for line in lines if "=" in line)


def _pause(folder: Path, name: str) -> None:
    """Claim the pause (a hard link fails when another process has it), then wait to be resumed."""
    mine = folder / f".{name}.{os.getpid()}"
    mine.write_text(str(os.getpid()))
    try:
        os.link(mine, folder / f"{name}.paused")
    except FileExistsError:
        return  # another process paused here first
    finally:
        mine.unlink()
    deadline = time.monotonic() + PAUSE_SECONDS
    while not (folder / f"{name}.resume").exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"fault pause at {name}: {folder}/{name}.resume never appeared")
        time.sleep(0.01)


def wait_paused(
    folder: Path, name: str, alive: Callable[[], bool] | None = None, timeout: float = PAUSE_SECONDS
) -> int:
    """(For tests.) The pid of the process paused at `name`, once it is there. `alive`: a callable
    that says whether the run is still going; when it stops first, RuntimeError."""
    paused = folder / f"{name}.paused"
    deadline = time.monotonic() + timeout
    while not paused.exists():
        if (alive is not None and not alive()) or time.monotonic() > deadline:
            raise RuntimeError(f"no process paused at {name} (it ended or never got there)")
        time.sleep(0.01)
    return int(paused.read_text())


def resume(folder: Path, name: str) -> None:
    """(For tests.) Let the process paused at `name` go on."""
    (folder / f"{name}.resume").touch()
