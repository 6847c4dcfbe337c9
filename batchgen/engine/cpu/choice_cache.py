"""A choice measured on this machine (a linear kernel mask, a decode key layout), cached on disk and
written once: two processes measuring at once may disagree, and the first stored answers for all;
and the interleaved timing such choices share.

Written once means a choice measured in a busy spell stays: `batchgen doctor` lists what is stored
and when it was measured (measured_choices), and `batchgen doctor --remeasure` forgets it all
(forget_choices) so the next engine measures again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from batchgen.engine.cpu import native

logger = logging.getLogger(__name__)

K = TypeVar("K")


def choice_path(folder: str, key: str) -> Path:
    """Where the choice for `key` is cached: per torch version and thread count (both move timings)."""
    what = f"{torch.__version__}\0{torch.get_num_threads()}\0{key}"
    return native.cache_dir() / folder / f"{hashlib.sha256(what.encode()).hexdigest()[:24]}.json"


def read_choice(path: Path, field: str) -> Any | None:
    """The stored choice's `field`, or None where nothing (readable) is stored."""
    try:
        return json.loads(path.read_text())[field]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_once(path: Path, field: str, record: dict[str, Any]) -> Any:
    """Store `record` unless another process stored one first; the stored `field` either way
    (`record[field]` itself where the cache cannot be written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=path.parent)
    except OSError as exc:
        logger.warning("%s not cached (%s): it is measured again in the next process", path.parent.name, exc)
        return record[field]
    with os.fdopen(fd, "w") as f:
        json.dump({**record, "threads": torch.get_num_threads(), "torch": torch.__version__}, f)
    try:
        os.link(tmp, path)  # never replaces: the first process's measurement is everyone's
    except FileExistsError:
        pass
    except OSError as exc:  # a file system without hard links: a rename, which may replace a twin's
        logger.debug("no hard link for %s (%s): renamed", path, exc)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    stored = read_choice(path, field)
    return record[field] if stored is None else stored


def measured_choices() -> dict[str, dict[str, Any]]:
    """Per folder of stored choices in the kernel cache: how many, and when the oldest and the newest
    were measured (their files' times, UTC)."""
    times: dict[str, list[float]] = {}
    for choice in _stored():
        try:
            times.setdefault(choice.parent.name, []).append(choice.stat().st_mtime)
        except OSError:  # forgotten meanwhile
            continue
    stamp = functools.partial(time.strftime, "%Y-%m-%d %H:%M")
    return {
        folder: {"count": len(ts), "oldest": stamp(time.gmtime(min(ts))), "newest": stamp(time.gmtime(max(ts)))}
        for folder, ts in sorted(times.items())
    }


def _stored() -> list[Path]:
    """Every stored choice: the JSON files one folder below the kernel cache."""
    root = native.cache_dir()
    return list(root.glob("*/*.json")) if root.is_dir() else []


def forget_choices() -> int:
    """Remove every stored choice, so the next engine to need one measures it again; how many went."""
    gone = 0
    for choice in _stored():
        try:
            choice.unlink()
            gone += 1
        except FileNotFoundError:  # another process forgot it first
            continue
    return gone


def interleaved_best(
    calls: Mapping[K, Callable[[], object]], rounds: int, deadline: float = float("inf")
) -> dict[K, float] | None:
    """Per key, the best seconds of one call, over `rounds` rounds after a warm-up round, each round
    making every call in turn; None where a round would start past `deadline` (time.monotonic).
    Why interleaved: on a shared host a busy spell lasts seconds; rounds over every candidate let one
    spell slow every side of one round rather than one side of every round."""
    best = dict.fromkeys(calls, float("inf"))
    with torch.inference_mode():
        for i in range(rounds + 1):
            if time.monotonic() > deadline:
                return None
            for key, call in calls.items():
                started = time.perf_counter()
                call()
                took = time.perf_counter() - started
                if i:
                    best[key] = min(best[key], took)
    return best
