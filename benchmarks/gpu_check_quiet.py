"""Warnings and library log lines of the GPU check, counted and printed once per kind.

Why: an unattended run's output is read through its last few thousand characters; transformers'
generation notices, dynamo's recompile notes and the engine's per-load lines repeated hundreds of
times there hide the one line that matters. Each kind (category and text, or logger and message
template) is printed the first time and counted after; the counts go into the JSON report.
The check's own logger ("gpu_check") is never folded.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections import Counter
from typing import Any, TextIO

OWN_LOGGER = "gpu_check"


class Quiet:
    """Installs itself on `warnings` and the root logger; `summary()` gives the counts by kind."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.counts: Counter[str] = Counter()

    def install(self) -> None:
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' loading bars
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        warnings.simplefilter("always")  # why: we count every one; the filter below prints each kind once
        warnings.showwarning = self._show_warning
        handler = logging.StreamHandler(self.stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s", "%H:%M:%S"))
        handler.addFilter(self._first_of_kind)
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(logging.WARNING)
        logging.getLogger(OWN_LOGGER).setLevel(logging.INFO)
        self._route_transformers()
        self._route_torch()

    def _route_transformers(self) -> None:
        """transformers logs through a handler of its own and shows bars: send it to ours, no bars."""
        try:
            from transformers.utils import logging as tf_logging
        except ImportError:  # pragma: no cover - the check needs transformers anyway
            return
        tf_logging.disable_default_handler()
        tf_logging.enable_propagation()
        tf_logging.disable_progress_bar()

    def _route_torch(self) -> None:
        """torch's loggers (torch, torch._dynamo, torch._inductor, ...) print through handlers of their
        own and do not propagate: route them to ours (their levels stay: warnings and up)."""
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            ours = (name == "torch" or name.startswith("torch.")) and "__trace" not in name  # (trace: DEBUG, off)
            if ours and isinstance(logger, logging.Logger) and logger.handlers and not logger.propagate:
                logger.handlers.clear()
                logger.propagate = True

    def _show_warning(
        self,
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = str(message).strip().splitlines()[0][:200] if str(message).strip() else ""
        kind = f"{category.__name__}: {text}"
        self.counts[kind] += 1
        if self.counts[kind] == 1:
            print(f"warning (first of its kind; counted after): {kind} [{filename}:{lineno}]", file=self.stream)

    def _first_of_kind(self, record: logging.LogRecord) -> bool:
        if record.name == OWN_LOGGER or record.name.startswith(OWN_LOGGER + "."):
            return True
        kind = f"{record.levelname} {record.name}: {str(record.msg)[:200]}"
        self.counts[kind] += 1
        return self.counts[kind] == 1

    def summary(self) -> dict[str, Any]:
        """{"total": n, "kinds": {kind: count}} (most frequent first)."""
        return {"total": sum(self.counts.values()), "kinds": dict(self.counts.most_common())}
