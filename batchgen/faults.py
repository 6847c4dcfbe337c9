"""Named fault-injection points for crash-safety tests.

Set BATCHGEN_FAULT=<point> (or <point>:<n> to fire on the n-th pass) in a test's subprocess.
`kill` points SIGKILL the process, exactly like the OOM killer would (BATCHGEN_FAULT_SIGNAL=SIGTERM
or SIGINT sends that signal instead, as a scheduler or Ctrl-C would, at that exact line); `raise`
points raise an exception, like a failing engine; `disk_full` raises OSError(ENOSPC) on the n-th
local atomic write (a part, the record or `_SUCCESS`), after its temp file holds the data, as a
file system that fills up mid-write would; `store_unavailable` raises the error of an object store
whose retries were spent, as a Ray worker starts a part. Unset, every point is one dictionary lookup.
"""

from __future__ import annotations

import errno
import os
import signal

_KILL_POINTS = {
    "after_temp_write",
    "after_rename",
    "before_success",
    "mid_engine",
    "record_temp_write",
    "success_temp_write",
    "lease_write",
}
_RAISE_POINTS = {"engine_exception"}
_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("BATCHGEN_FAULT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != int(nth or 1):
        return
    if name in _KILL_POINTS:
        os.kill(os.getpid(), signal.Signals[os.environ.get("BATCHGEN_FAULT_SIGNAL", "SIGKILL")])
    if name == "disk_full":
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (injected fault)")
    if name == "store_unavailable":
        from batchgen.errors import StoreUnavailable

        raise StoreUnavailable("injected fault store_unavailable: the store's retries were spent")
    if name in _RAISE_POINTS:
        raise RuntimeError(f"injected fault {name}: simulated engine failure (e.g. NaN logits)")
