"""Generation backends behind one interface: `native` (our engine) and `hf` (transformers generate),
and the check that a model folder's weight files can be read (weights)."""

from __future__ import annotations

import logging
from typing import Any

from batchgen.backends.base import Backend
from batchgen.job.spec import JobSpec

log = logging.getLogger(__name__)

# engine.compile "auto" in a job compiles only for a process that runs at least this many rows.
# Why: on the CPU compiling costs 5-20 s once per process and saves 5-15% of the engine's time
# (benchmarks/RESULTS.md, fourth pass): the quickstart's 300 rows took 12.5 s compiled against 7.0 s
# eager, the 2,400 rows of jobs/example.yaml broke even (53.4 s against 51.1 s).
COMPILE_MIN_ROWS = 5_000
SMALLEST_DEFAULT_SEQS = 64  # engine.max_num_seqs's default on the CPU (256 on CUDA)


def load_backend(spec: JobSpec, tokenizer: Any) -> Backend:
    if spec.task != "generate":
        from batchgen.backends.pooling import PoolingBackend

        return PoolingBackend(spec, tokenizer)  # type: ignore[return-value]  # pooling parts call .run
    if spec.engine.backend == "hf":
        from batchgen.backends.hf import HFBackend

        return HFBackend(spec, tokenizer)
    from batchgen.backends.native import NativeBackend

    return NativeBackend(spec, tokenizer)


def for_rows(spec: JobSpec, rows: int) -> JobSpec:
    """The job as one process running `rows` rows should load it: engine.compile "auto" turned off
    for fewer than COMPILE_MIN_ROWS rows, and max_num_seqs, when unset, no larger than the
    sequences the rows can have (rows x n), so a tiny job's KV pool and decode rows are sized for
    it, not for 64 sequences (an explicit value of either setting is kept)."""
    if spec.engine.backend != "native":
        return spec
    update: dict[str, Any] = {}
    if spec.engine.compile == "auto" and rows < COMPILE_MIN_ROWS:
        log.info(
            "engine.compile auto: eager for %d rows (compiling pays off from about %d rows)", rows, COMPILE_MIN_ROWS
        )
        update["compile"] = False
    sequences = max(1, rows) * spec.sampling.n
    if spec.engine.max_num_seqs is None and sequences < SMALLEST_DEFAULT_SEQS:
        update["max_num_seqs"] = sequences
    return spec.model_copy(update={"engine": spec.engine.model_copy(update=update)}) if update else spec
