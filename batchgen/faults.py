"""Named fault-injection points for crash-safety tests.

Set BATCHGEN_FAULT=<point> (or <point>:<n> to fire on the n-th pass) in a test's subprocess.
`kill` points SIGKILL the process, exactly like the OOM killer would (BATCHGEN_FAULT_SIGNAL=SIGTERM
or SIGINT sends that signal instead, as a scheduler or Ctrl-C would, at that exact line); `raise`
points raise an exception, like a failing engine. Unset, every point is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

_KILL_POINTS = {
    "after_temp_write",
    "after_rename",
    "before_success",
    "mid_engine",
    "record_temp_write",
    "part_record_write",
    "runtime_record_write",
    "success_temp_write",
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
    if name in _RAISE_POINTS:
        raise RuntimeError(f"injected fault {name}: simulated engine failure (e.g. NaN logits)")
