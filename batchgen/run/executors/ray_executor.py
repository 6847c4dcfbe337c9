"""The Ray executor (`executor: {kind: ray}`): one job over every GPU of a node or a cluster.

The driver (the `batchgen run` process) plans the parts and skips committed ones as always, then
hands the rest, one at a time, to long-lived engine workers (Ray actors, ray_worker.py) through a
PartQueue: dynamic, so fast workers take more, and contiguous, so neighbouring parts share a
worker's prefix cache. It holds no rows: a worker reads its part from the input itself and
commits it. The driver shows one bar, sums the parts' totals for `_SUCCESS` and the summary.

Faults: a worker that dies mid-part (kill -9, OOM) leaves its part uncommitted; a new worker
takes its place and that part first, and the job finishes in the same run (a part whose worker
dies MAX_ATTEMPTS times stops the job with exit 6). A transient store error that a worker's own
retries could not outlast is the store's, not the engine's: the part is handed out again
(MAX_ATTEMPTS times, then exit 10). An engine error in a worker is today's engine failure
(exit 6: committed parts stay, a rerun resumes); the driver killed: a rerun resumes.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from batchgen.backends import for_rows
from batchgen.errors import BatchgenError, EngineFailure, StoreUnavailable
from batchgen.inputs.dataset import InputFile, Shard
from batchgen.inputs.duplicate_ids import IdProblem
from batchgen.inputs.part_rows import GroupedPart, Part, describe, file_offsets
from batchgen.job.sections import ExecutorSection
from batchgen.outputs.parts import PartWriter
from batchgen.outputs.state import OutputState
from batchgen.outputs.totals import Totals
from batchgen.run import interrupt
from batchgen.run.executors.part_queue import PartQueue
from batchgen.run.executors.ray_cluster import WorkerShape, connect, import_ray, plan_workers
from batchgen.run.executors.ray_groups import in_group, release_groups, replica_group
from batchgen.run.executors.ray_worker import PartWorker, ProgressBoard
from batchgen.run.part_work import PartWork
from batchgen.run.progress import RunProgress, row_token_budget
from batchgen.storage.retry import is_transient

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3  # a part whose worker dies this often stops the job (exit 6) instead of looping
POLL_SECONDS = 0.5  # the driver checks for signals and refreshes the bar this often


@dataclass
class RayStats:
    """Where the parts went: for the log line and benchmarks/ray_overhead.py."""

    workers: int = 0
    parts: list[list[int]] = field(default_factory=list)  # per worker slot, in the order taken
    last_done: list[float] = field(default_factory=list)  # per slot: when its last part was committed
    replaced: int = 0  # workers that died and were replaced

    def tail_idle(self) -> list[float]:
        """Per slot: seconds it sat idle between its last part and the job's last part."""
        end = max(self.last_done, default=0.0)
        return [round(end - t, 3) if t else 0.0 for t in self.last_done]


class RayExecutor:
    def __init__(self, section: ExecutorSection, quiet: bool = False) -> None:
        self.ray = import_ray()
        self.quiet = quiet
        self.owns_ray = connect(self.ray, section.address, quiet)
        try:
            self.shape = plan_workers(section, self.ray.cluster_resources())
        except BaseException:
            self.close()
            raise
        self.stats = RayStats()

    def process(
        self,
        work: PartWork,
        files: list[InputFile],
        carried: list[str],
        writer: PartWriter,
        todo: list[Part],
        totals: Totals,
    ) -> None:
        dispatch = _Dispatch(self.ray, work, files, carried, writer, self.shape, todo, self.quiet)
        try:
            dispatch.run(totals)
        finally:
            self.stats = dispatch.stats
        idle = dispatch.stats.tail_idle()
        counts = [len(p) for p in dispatch.stats.parts]
        log.info("ray: %d worker(s); parts per worker %s; idle at the end (s) %s", self.shape.count, counts, idle)

    def close(self) -> None:
        if self.owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
        self.owns_ray = False


class _Dispatch:
    """One run's parts over the workers: submit, collect, replace dead workers, show progress."""

    def __init__(
        self,
        ray: ModuleType,
        work: PartWork,
        files: list[InputFile],
        carried: list[str],
        writer: PartWriter,
        shape: WorkerShape,
        todo: list[Part],
        quiet: bool,
    ) -> None:
        self.ray, self.shape, self.quiet, self.work = ray, shape, quiet, work
        self.total_rows = sum(s.num_rows for s in todo)
        spec = for_rows(work.spec, -(-self.total_rows // shape.count))  # each worker's share of the rows
        self.args = (spec, files, carried, writer, shape.cpus)
        self.storage = writer.storage
        self.queue = PartQueue(todo, shape.count)
        self.files = files
        self.duplicates = _duplicates_by_part(work.duplicates, todo, files)
        self.board = ray.remote(num_cpus=0)(ProgressBoard).remote()
        self.actor_options: dict[str, Any] = dict(num_cpus=shape.cpus, num_gpus=shape.gpus, max_restarts=0)
        self.actor_class = ray.remote(PartWorker)
        self.actor = self.actor_class.options(**self.actor_options)
        self.groups: dict[int, Any] = {}  # slot -> its placement group (tensor parallel workers)
        self.workers: dict[int, Any] = {}
        self.inflight: dict[Any, tuple[int, Part, int]] = {}  # object ref -> (slot, part, attempt)
        self.attempts: dict[int, int] = {}  # part index -> workers that died on it
        self.store_attempts: dict[int, int] = {}  # part index -> transient store failures
        self.stats = RayStats(shape.count, [[] for _ in range(shape.count)], [0.0] * shape.count)
        self.done_rows = 0
        self.run_tokens = 0

    def run(self, totals: Totals) -> None:
        bar = RunProgress(self.total_rows, self.quiet, budget=row_token_budget(self.work.spec))
        try:
            with bar, interrupt.cooperative():
                for slot in range(self.shape.count):
                    self.workers[slot] = self._new_worker(slot)
                if self.work.replacing_output:  # --overwrite: the old output goes once the models load
                    self._wait_loaded()
                    self.work.take_over_output()
                for slot in range(self.shape.count):
                    self._submit(slot)
                while self.inflight:
                    ready, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=POLL_SECONDS)
                    interrupt.check()
                    for ref in ready:
                        self._collect(ref, totals)
                    self._show(bar)
        finally:
            for worker in self.workers.values():
                self.ray.kill(worker, no_restart=True)  # an abandoned part stays uncommitted
            self.ray.kill(self.board, no_restart=True)
            release_groups(self.ray, self.groups)

    def _wait_loaded(self) -> None:
        """Until every worker has loaded its model; a load that fails stops the job (its error:
        a ModelError is exit 4) before anything of the old output is touched."""
        pending = [self.workers[slot].load.remote() for slot in self.workers]
        while pending:
            ready, pending = self.ray.wait(pending, num_returns=len(pending), timeout=POLL_SECONDS)
            interrupt.check()
            for ref in ready:
                try:
                    self.ray.get(ref)
                except self.ray.exceptions.RayTaskError as exc:
                    if isinstance(exc.cause, BatchgenError):
                        raise exc.cause from None
                    raise EngineFailure(f"a Ray worker failed to load the model: {exc.cause!r}") from None
                except self.ray.exceptions.RayError as exc:
                    raise EngineFailure(f"a Ray worker died loading the model ({type(exc).__name__})") from None

    def _new_worker(self, slot: int) -> Any:
        """The engine actor of `slot`; with tensor parallelism inside the slot's placement group
        (made once: a replacement worker gets the same reserved GPUs)."""
        size = self.work.spec.engine.tensor_parallel_size
        if size == 1:
            return self.actor.remote(*self.args, self.board)
        if slot not in self.groups:
            self.groups[slot] = replica_group(self.ray, self.shape, size)
        placed = self.actor_class.options(**self.actor_options, scheduling_strategy=in_group(self.groups[slot]))
        return placed.remote(*self.args, self.board)

    def _start(self, slot: int) -> None:
        self.workers[slot] = self._new_worker(slot)
        self._submit(slot)

    def _submit(self, slot: int) -> None:
        part = self.queue.next_for(slot)
        if part is None:
            return
        attempt = self.attempts.get(part.index, 0)
        ref = self.workers[slot].run_part.remote(part, self.duplicates.get(part.index, {}), attempt)
        self.inflight[ref] = (slot, part, attempt)

    def _collect(self, ref: Any, totals: Totals) -> None:
        slot, part, _ = self.inflight.pop(ref)
        try:
            done = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as exc:  # the worker raised: an engine or input error
            cause = exc.cause
            if isinstance(cause, StoreUnavailable) or is_transient(cause):
                self._again(slot, part, cause)  # the store, not the part: the same worker tries it again
                return
            if isinstance(cause, BatchgenError):
                raise cause from None
            raise EngineFailure(f"a Ray worker failed on part {part.index}: {cause!r}") from None
        except self.ray.exceptions.RayError as exc:  # the worker process died (kill -9, OOM) or was lost
            self._replace(slot, part, exc)
            return
        totals.merge(done.totals)
        self.done_rows += part.num_rows
        self.run_tokens += done.totals.output_tokens
        self.stats.parts[slot].append(part.index)
        self.stats.last_done[slot] = time.time()
        self._submit(slot)

    def _again(self, slot: int, part: Part, cause: BaseException) -> None:
        """Part `part` failed on a transient store error (its worker's own retries spent): hand it
        out again, up to MAX_ATTEMPTS times, then stop with that error (exit 10: rerun to resume)."""
        tries = self.store_attempts[part.index] = self.store_attempts.get(part.index, 0) + 1
        if tries >= MAX_ATTEMPTS:
            if isinstance(cause, StoreUnavailable):
                raise cause
            raise StoreUnavailable(f"part {part.index}: transient store errors {tries} times, last: {cause!r}")
        log.warning(
            "Ray worker %d: part %d failed on a transient store error (%r); trying it again", slot, part.index, cause
        )
        self.queue.give_back(slot, part)
        self._submit(slot)

    def _replace(self, slot: int, part: Part, exc: Exception) -> None:
        died = self.attempts[part.index] = self.attempts.get(part.index, 0) + 1
        if died >= MAX_ATTEMPTS:
            raise EngineFailure(
                f"part {part.index} ({describe(part, self.files)}): its Ray "
                f"worker died {died} times ({type(exc).__name__}: out of memory?); committed parts are kept, "
                "rerun to resume"
            )
        why = type(exc).__name__
        log.warning("Ray worker %d died on part %d (%s); a new worker takes it over", slot, part.index, why)
        self.ray.kill(self.workers[slot], no_restart=True)
        OutputState(self.storage).remove_leftovers(lambda index: index == part.index)  # a half-written temp file
        self.stats.replaced += 1
        self.queue.give_back(slot, part)
        self._start(slot)

    def _show(self, bar: RunProgress) -> None:
        if self.quiet:
            return
        board = self.ray.get(self.board.snapshot.remote())
        under_way = [board.get((part.index, attempt), (0, 0)) for _, part, attempt in self.inflight.values()]
        bar.extra = f"{len(self.inflight)} workers"
        bar.show(self.done_rows + sum(r for r, _ in under_way), self.run_tokens + sum(t for _, t in under_way))


def _duplicates_by_part(
    duplicates: dict[tuple[int, int], IdProblem], todo: list[Part], files: list[InputFile]
) -> dict[int, dict[tuple[int, int], IdProblem]]:
    """The driver's job-wide id problems, cut per part: each worker gets only its part's rows."""
    shards = [p for p in todo if isinstance(p, Shard)]
    by_file: dict[int, list[Shard]] = {}
    for part in sorted(shards, key=lambda s: (s.file_index, s.start)):
        by_file.setdefault(part.file_index, []).append(part)
    starts = {f: [p.start for p in parts] for f, parts in by_file.items()}
    out: dict[int, dict[tuple[int, int], IdProblem]] = {}
    for (file_index, row), problem in duplicates.items():
        parts = by_file.get(file_index, [])
        i = bisect.bisect_right(starts.get(file_index, []), row) - 1
        if i >= 0 and row < parts[i].stop:
            out.setdefault(parts[i].index, {})[(file_index, row)] = problem
    grouped = [p for p in todo if isinstance(p, GroupedPart)]
    if grouped and duplicates:
        offsets = file_offsets(files)
        at = {int(offsets[f]) + r: (f, r) for f, r in duplicates}  # input position -> (file, row)
        positions = np.fromiter(at, dtype=np.int64, count=len(at))
        for grouped_part in grouped:
            rows = grouped_part.rows
            for position in rows[np.isin(rows, positions)].tolist():
                out.setdefault(grouped_part.index, {})[at[position]] = duplicates[at[position]]
    return out
