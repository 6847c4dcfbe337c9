"""Cooperative stopping on SIGTERM and SIGINT.

Why: a handler that raises from whatever line runs can land inside a part's write or fsync and
leave a temp file behind (or half-update engine state). Inside `cooperative()` (generation and
commits) the handler only records the signal; the runner calls `check()` between requests'
outputs and between parts, where stopping is clean. Outside it (validation, hashing, model
loading: nothing is being written) the handler raises at once so a stop is never delayed by a
long load. A second signal always raises at once: a user who insists is not kept waiting, and
every temp write still removes its file on any exception.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from batchgen.errors import Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_pending: list[int] = []  # signals received and not yet acted on
_depth = 0  # nesting of cooperative() sections


def _handler(signum: int, _frame: FrameType | None) -> None:
    _pending.append(signum)
    if _depth == 0 or len(_pending) > 1:
        raise Interrupted(_pending[0])


@contextmanager
def installed() -> Iterator[None]:
    """Route SIGTERM and SIGINT to the flag for the duration; restore the old handlers after."""
    _pending.clear()
    old: dict[int, Any] = {s: signal.signal(s, _handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _pending.clear()


@contextmanager
def cooperative() -> Iterator[None]:
    """Within this block a (first) signal only sets the flag; the caller acts on it with `check()`."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def requested() -> int | None:
    """The signal that asked the run to stop, if any."""
    return _pending[0] if _pending else None


def check() -> None:
    """Stop here (raise Interrupted) when a signal has arrived; a safe point between writes."""
    if _pending:
        raise Interrupted(_pending[0])
