"""What runs inside Ray: the engine worker (one actor per GPU, or per CPU share) and the progress
board the driver's bar reads. Plain classes: ray_executor.py makes them actors, so this module
imports no Ray and its classes pickle by reference (batchgen must be installed on every node).

A worker loads the model once, then per call reads its part's rows itself from the input (the
driver sends a part's row range, never its rows), generates, and commits the part through
`PartWork.process_part`: the same PartWriter, the same atomic commit that never replaces a
committed part, as a local run.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from batchgen.backends.base import Backend
from batchgen.errors import EngineFailure
from batchgen.faults import fault_point
from batchgen.inputs.dataset import InputFile
from batchgen.inputs.duplicate_ids import IdProblem
from batchgen.inputs.part_rows import Part, read_parts
from batchgen.inputs.prepare import RowPreparer
from batchgen.job.spec import JobSpec
from batchgen.outputs.parts import PartWriter
from batchgen.outputs.totals import Totals
from batchgen.run.part_work import PartWork, load_engine, read_columns

REPORT_SECONDS = 0.5  # how often a worker tells the board its rows done in the part at hand

AttemptKey = tuple[int, int]  # (part index, attempt): a retried part's count starts afresh


@dataclass
class PartDone:
    index: int
    totals: Totals
    pid: int  # the worker process that committed it


class ProgressBoard:
    """(rows, output tokens) finished so far in each part under way, as the workers last reported them."""

    def __init__(self) -> None:
        self.rows: dict[AttemptKey, tuple[int, int]] = {}

    def set(self, key: AttemptKey, rows: int, tokens: int = 0) -> None:
        self.rows[key] = (rows, tokens)

    def snapshot(self) -> dict[AttemptKey, tuple[int, int]]:
        return dict(self.rows)


class _Reporter:
    """The worker's RowCounter: counts rows and their output tokens, and posts both to the board
    every REPORT_SECONDS."""

    def __init__(self, board: Any, key: AttemptKey) -> None:
        self.board, self.key = board, key
        self.done, self.tokens, self.posted = 0, 0, time.monotonic()

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.done += n
        self.tokens += tokens
        if time.monotonic() - self.posted >= REPORT_SECONDS:
            self.board.set.remote(self.key, self.done, self.tokens)  # fire and forget: progress only
            self.posted = time.monotonic()


class PartWorker:
    """One engine worker: the model is loaded on its first part and kept for the next ones."""

    def __init__(
        self,
        spec: JobSpec,
        files: list[InputFile],
        carried: list[str],
        writer: PartWriter,
        cpus: float,
        board: Any,
    ) -> None:
        import torch

        torch.set_num_threads(max(1, int(cpus)))  # why: the CPUs Ray reserved for this worker, no more
        self.spec, self.files, self.carried, self.writer, self.board = spec, files, carried, writer, board
        self.engine: tuple[Backend, RowPreparer] | None = None

    def pid(self) -> int:
        return os.getpid()

    def load(self) -> int:
        """Load the model now (else the first part does); this worker's pid."""
        self._engine()
        return os.getpid()

    def _engine(self) -> tuple[Backend, RowPreparer]:
        if self.engine is None:
            self.engine = load_engine(self.spec)
        return self.engine

    def run_part(self, part: Part, duplicates: dict[tuple[int, int], IdProblem], attempt: int) -> PartDone:
        """Read part `part`'s rows, generate and commit them; `duplicates` are its rows whose id
        fails (judged by the driver over the whole job). The engine, and with it the prefix cache,
        stays from part to part: the next part of the group this worker holds starts warm."""
        fault_point("store_unavailable")
        backend, preparer = self._engine()
        rows = next(read_parts(self.files, [part], read_columns(self.spec, self.carried)))
        work = PartWork(self.spec, duplicates)
        reporter = _Reporter(self.board, (part.index, attempt))
        try:
            totals = work.process_part(self.files, rows, self.carried, self.writer, backend, preparer, reporter)
        except EngineFailure as exc:
            # (by name: importing the engine's parallel room here would load torch into the driver)
            if type(exc.__cause__).__name__ == "TensorParallelError":
                # why exit: a rank of this worker's group died, so the group is gone; the driver
                # sees a dead worker, starts a new one (a new group) and hands it this part again
                sys.stderr.write(f"batchgen: tensor-parallel worker group lost ({exc}); exiting\n")
                os._exit(1)
            raise
        return PartDone(part.index, totals, os.getpid())
