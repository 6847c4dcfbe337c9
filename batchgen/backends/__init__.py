"""Generation backends behind one interface: `native` (our engine) and `hf` (transformers generate)."""

from __future__ import annotations

import logging
from typing import Any

from batchgen.backends.base import Backend
from batchgen.job import JobSpec

log = logging.getLogger(__name__)

# engine.compile "auto" in a job compiles only for a process that runs at least this many rows.
# Why: on the CPU compiling costs 5-20 s once per process and saves 5-15% of the engine's time
# (benchmarks/RESULTS.md, fourth pass): the quickstart's 300 rows took 12.5 s compiled against 7.0 s
# eager, the 2,400 rows of jobs/example.yaml broke even (53.4 s against 51.1 s).
COMPILE_MIN_ROWS = 5_000


def load_backend(spec: JobSpec, tokenizer: Any) -> Backend:
    if spec.engine.backend == "hf":
        from batchgen.backends.hf import HFBackend

        return HFBackend(spec, tokenizer)
    from batchgen.backends.native import NativeBackend

    return NativeBackend(spec, tokenizer)


def for_rows(spec: JobSpec, rows: int) -> JobSpec:
    """The job as one process running `rows` rows should load it: engine.compile "auto" turned off
    for fewer than COMPILE_MIN_ROWS rows (an explicit true or false is kept)."""
    if spec.engine.backend != "native" or spec.engine.compile != "auto" or rows >= COMPILE_MIN_ROWS:
        return spec
    log.info("engine.compile auto: eager for %d rows (compiling pays off from about %d rows)", rows, COMPILE_MIN_ROWS)
    return spec.model_copy(update={"engine": spec.engine.model_copy(update={"compile": False})})
