"""The thread governor's side of a compiled CPU forward: kernels that read the thread count when
they run, and a check of the traced state that leaves the count out.

Why: by default inductor bakes the compile-time thread count into every kernel and dynamo guards
on it, so a forward compiled while the governor had lowered the count ran one thread forever, and
each new count recompiled the whole forward mid-job.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from batchgen.engine.api.platform import CompilePolicy

logger = logging.getLogger(__name__)


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
