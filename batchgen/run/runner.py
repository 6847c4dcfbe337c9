"""The job lifecycle: check, lock the output, skip committed parts, then for each remaining shard
read, prepare, order, generate, commit; then the `_SUCCESS` manifest and a summary."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from batchgen.backends import for_rows
from batchgen.backends.base import Backend
from batchgen.faults import fault_point
from batchgen.inputs.dataset import InputFile, column_field, plan_shards, with_rows
from batchgen.inputs.duplicate_ids import find_duplicate_ids
from batchgen.inputs.part_rows import Part, read_parts
from batchgen.inputs.sharding import ShardSpec
from batchgen.inputs.vision_rows import wave_rows
from batchgen.job.spec import JobSpec
from batchgen.outputs.committed_types import committed_schema
from batchgen.outputs.completion import build_manifest, complete_from_parts, run_facts
from batchgen.outputs.fingerprint import job_fingerprint
from batchgen.outputs.openai_batch import BatchFacts, write_batch_output
from batchgen.outputs.part_record import audit_parts, redo_bad_parts
from batchgen.outputs.parts import PartWriter
from batchgen.outputs.plan_file import Layout, grouped_layout, record_of, store_plan
from batchgen.outputs.runtime_record import recorded_dtype
from batchgen.outputs.state import OutputLock, OutputState
from batchgen.outputs.table import carried_columns, output_schema
from batchgen.outputs.totals import Totals
from batchgen.run import interrupt
from batchgen.run.executors import Executor, open_executor
from batchgen.run.layout import decide_layout, key_block_size, shard_owns
from batchgen.run.part_work import PartWork, load_engine, read_columns
from batchgen.run.progress import LoadingStatus, RunProgress, loading_what, row_token_budget
from batchgen.run.summary import Summary
from batchgen.run.validate import validate_inputs, validate_model

log = logging.getLogger(__name__)


class JobRunner:
    def __init__(
        self,
        spec: JobSpec,
        quiet: bool = False,
        overwrite: bool = False,
        shard: ShardSpec | None = None,
        allow_precision_change: bool = False,
    ) -> None:
        self.spec = spec
        self.allow_precision_change = allow_precision_change  # parts of other runtimes may stay (runtime_record)
        self.shard = shard  # None: every part; else only the parts this static shard owns
        self.quiet = quiet
        self.overwrite = overwrite
        self.executor: Executor | None = None  # None: parts run in this process
        self._replacing: tuple[OutputState, dict[str, Any]] | None = None  # --overwrite, old output still there
        self.lock: OutputLock | None = None
        self._model_checked = False
        self.layout: Layout | None = None
        self.work = PartWork(spec, handover=self)  # how each part is made, here or on a Ray worker

    def run(self) -> Summary:
        start = time.time()
        files = validate_inputs(self.spec)  # fails here, before the output is touched, on bad inputs
        carried = carried_columns(self.spec, with_rows(files)[0].schema)
        add_row_id = self.spec.input.id_column is None
        fields = [column_field(files, c) for c in carried]
        schema = output_schema(fields, add_row_id, self.work.result_fields)
        self._schema = lambda input_row: output_schema(fields, add_row_id, self.work.result_fields, input_row)
        out = self.spec.output
        writer = PartWriter(out.path, schema, out.storage_options, out.single_writer, self.allow_precision_change)
        if writer.storage.local_dir is not None and not writer.storage.is_dir():
            self._validate_model()  # a new folder holds no finished job and no lock: check before creating it
        writer.prepare()
        lock = self.lock = OutputLock(writer.storage, self.shard)
        try:
            # Why the lock and the finished-job check before the model's checks: those import torch
            # and transformers (seconds, half a GB), and a locked or finished job needs neither.
            lock.acquire()
            return self._run_locked(files, carried, writer, start)
        finally:
            lock.release()
            if self.executor is not None:
                self.executor.close()

    def _run_locked(self, files: list[InputFile], carried: list[str], writer: PartWriter, start: float) -> Summary:
        state = OutputState(writer.storage)
        fingerprint = job_fingerprint(self.spec, files)
        batch_facts = BatchFacts.of(self.spec, fingerprint["id"])
        if not self.overwrite and state.check_record(fingerprint):
            manifest = state.read_success()
            # why: the output file is derived from the parts; a completed job whose file is gone gets it back
            write_batch_output(writer.storage, state.read_record() or {}, batch_facts, again=True)
            return Summary(Totals(), 0.0, manifest, already_done=True)
        self._validate_model()  # fails here, before any weights load, on a bad model folder or device
        self._open_executor()  # kind ray: Ray reached before any work; never for a finished job
        layout = self.layout = decide_layout(self.spec, files, state, fingerprint["id"], self.overwrite)
        writer.schema = self._schema(layout.input_row)
        shards = layout.parts
        record = {**fingerprint, "run": run_facts(self.spec, files, max(len(shards), 1), start)}
        if layout.input_row:  # why only then: an output made before prefix plans resumes as it was made
            record["grouping"] = record_of(self.spec, layout.grouped)
        if batch_facts is not None:
            record["run"]["openai_batch"] = batch_facts.to_record()
        if self.overwrite:
            # Why deferred: a job that fails to start (weights missing, a bad row type, Ray gone)
            # must not cost the old output; it goes only when the first new part is ready to commit.
            self._replacing = (state, record)
            committed: dict[int, str] = {}
        else:
            self._claim_output(state, record)
            committed = state.committed_parts()
        stored = state.read_record() or {}  # (as claimed: ours, or the first run's)
        self._resolve_dtype({} if self.overwrite else stored)
        layout = self.layout  # (_claim_output may have taken another run's stored plan)
        shards = layout.parts
        owns = shard_owns(layout, self.shard)
        mine = [s for s in shards if owns is None or owns(s.index)]
        # Why read whole: a kept part is trusted only when it is the one this job committed (part_record).
        audit = audit_parts(writer.storage, committed, {s.index: s.num_rows for s in mine}, stored)
        redone = redo_bad_parts(writer.storage, committed, audit)
        # why after the audit: a kept part's own column types decide (an older batchgen's narrower ones)
        writer.schema = committed_schema(
            writer.storage, {i: committed[i] for i in audit.kept if i in committed}, writer.schema
        )
        totals = Totals()
        for part_totals in audit.kept.values():
            totals.merge(part_totals)
        kept_output_tokens = totals.output_tokens
        todo = [s for s in mine if s.index not in committed]
        if self.spec.input.id_column is not None and todo:
            # Why every row in input order, not todo: the first occurrence wins wherever it lands.
            in_order = plan_shards(files, self.spec.engine.window_rows, self.spec.input.limit)
            self.work.duplicates = find_duplicate_ids(files, in_order, self.spec.input.id_column)
        if committed:
            log.info("resuming: %d of %d parts already committed", len(committed), len(shards))
        self._process(files, carried, writer, todo, totals)
        if not shards and 0 not in committed and (owns is None or owns(0)):
            self._commit_empty(writer)
        wall = time.time() - start
        run_tokens = totals.output_tokens - kept_output_tokens
        kept = len(mine) - len(todo)
        summary = Summary(totals, wall, {}, kept, run_output_tokens=run_tokens, redone=redone)
        if self.shard is not None:
            return self._finish_shard(state, record, summary)
        manifest = build_manifest(totals, state.read_record() or record, start, wall, run_tokens)
        self.take_over_output()  # (done at the first commit already; a job always commits one)
        fault_point("before_success")
        with interrupt.cooperative():
            interrupt.check()
            writer.write_success(manifest)
            write_batch_output(writer.storage, state.read_record() or record, batch_facts)
        summary.manifest = manifest
        return summary

    def _validate_model(self) -> None:
        if not self._model_checked:
            validate_model(self.spec)
            self._model_checked = True

    def _resolve_dtype(self, record: dict[str, Any]) -> None:
        """Log what model.dtype resolves to and why; `auto` on an output whose parts were all made in
        one dtype is pinned to it (runtime_record.recorded_dtype), here and on every worker."""
        from batchgen.engine.api.dtype_rule import for_job  # why lazy: it imports torch to ask for CUDA

        model = self.spec.model
        held = recorded_dtype(record) if model.dtype == "auto" else None
        if held is None:
            log.info("model %s: %s", model.path, for_job(model.dtype, model.device, str(model.path)).line(model.dtype))
            return
        log.info("model %s: dtype auto -> %s (resuming an output whose parts were made in %s)", model.path, held, held)
        self.spec = self.spec.model_copy(update={"model": model.model_copy(update={"dtype": held})})
        self.work.spec = self.spec

    def _open_executor(self) -> None:
        if self.executor is None:
            self.executor = open_executor(self.spec, self.quiet)

    def _claim_output(self, state: OutputState, record: dict[str, Any]) -> None:
        """Write the job record and the part plan (the first run of the job stores it; the others
        take the stored one), then remove a killed run's temp files (a shard: its own parts' only)."""
        with interrupt.cooperative():
            state.claim_record(record, refresh=self.shard is None)  # N shards may start at once
            layout = self.layout
            if layout is not None and layout.cut is not None:
                facts = {**record_of(self.spec, True), "block_size": key_block_size(self.spec)}
                self.layout = grouped_layout(store_plan(state.storage, layout.cut, record["id"], facts), stored=True)
        interrupt.check()
        owns = shard_owns(self.layout, self.shard) if self.layout is not None else None
        if state.remove_leftovers(owns):
            log.info("removed temporary files of an interrupted run")

    @property
    def replacing_output(self) -> bool:
        """--overwrite, and the old output is still there (see take_over_output)."""
        return self._replacing is not None

    def take_over_output(self) -> None:
        """--overwrite: this job has validated, loaded its model and is about to commit its first
        part; only now the old output goes and this job's record takes its place. Nothing to do
        after the first call (and on a Ray worker, whose runner replaces nothing)."""
        if self._replacing is None:
            return
        state, record = self._replacing
        self._replacing = None
        if self.lock is not None:  # an object store: never delete parts under another run's lease
            self.lock.check(fresh=True)
        with interrupt.cooperative():  # a signal now waits: the folder is never left half replaced
            removed = state.overwrite()
            log.info("--overwrite: removed the previous output (%d parts)", removed)
            state.check_record(record)  # nothing of the old job is left: this reads no record
            self._claim_output(state, record)

    def _finish_shard(self, state: OutputState, record: dict[str, Any], summary: Summary) -> Summary:
        """This shard's parts are committed: write `_SUCCESS` if every other part is too."""
        fault_point("before_success")
        with interrupt.cooperative():
            interrupt.check()
            manifest, missing = complete_from_parts(state, record)
        planned = record["run"]["parts"]
        summary.manifest = manifest or {}
        if manifest is not None:
            summary.note = f"job: all {planned} parts committed, _SUCCESS written"
        else:
            summary.note = f"job: {planned - len(missing)} of {planned} parts committed, the rest are other shards'"
        summary.shard = str(self.shard)
        return summary

    def _commit_empty(self, writer: PartWriter) -> None:
        """No input rows: one empty part with the full output schema, so that every finished output
        reads back with its columns (`pyarrow.dataset.dataset(out).schema`)."""
        self.take_over_output()
        with interrupt.cooperative():
            writer.write_part(0, writer.schema.empty_table())

    def _process(
        self,
        files: list[InputFile],
        carried: list[str],
        writer: PartWriter,
        todo: list[Part],
        totals: Totals,
    ) -> None:
        if not todo:
            return
        if self.executor is not None:  # the parts run elsewhere; each worker calls PartWork.process_part
            self.executor.process(self.work, files, carried, writer, todo, totals)
            return
        with LoadingStatus(loading_what(self.spec), self.quiet):
            backend, preparer = load_engine(for_rows(self.spec, sum(s.num_rows for s in todo)))
        budget = row_token_budget(self.spec, backend.max_model_len)
        bar = RunProgress(sum(s.num_rows for s in todo), self.quiet, live_output_tokens(backend), budget)
        # Why cooperative: a signal only sets a flag here; the loop and on_output stop at clean points.
        with bar, interrupt.cooperative():
            for part in read_parts(files, todo, read_columns(self.spec, carried), wave_rows(self.spec)):
                interrupt.check()
                totals.merge(self.work.process_part(files, part, carried, writer, backend, preparer, bar))


def live_output_tokens(backend: Backend) -> Callable[[], int] | None:
    """The engine's count of output tokens sampled so far, running requests' included, for the
    progress bar's rate; None for a backend that keeps none (hf: its rows finish batch by batch)."""
    if getattr(backend, "stats", None) is None:
        return None
    return lambda: int(getattr(backend, "stats", {}).get("output_tokens", 0))
