"""The job lifecycle: check, lock the output, skip committed parts, then for each remaining shard
read, prepare, order, generate, commit; then the `_SUCCESS` manifest and a summary."""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
from tqdm import tqdm

import batchgen
from batchgen.backends import load_backend
from batchgen.backends.base import Backend
from batchgen.dataset import InputFile, Shard, plan_shards, read_shards
from batchgen.engine.outputs import RequestOutput
from batchgen.errors import BatchgenError, EngineFailure
from batchgen.faults import fault_point
from batchgen.fingerprint import job_fingerprint
from batchgen.idcheck import IdProblem, find_duplicate_ids
from batchgen.job import JobSpec
from batchgen.jobstate import SUCCESS_NAME, OutputLock, OutputState
from batchgen.ordering import order_requests
from batchgen.output import PartWriter, Totals, output_schema
from batchgen.prepare import RowPreparer
from batchgen.results import part_table, result_columns
from batchgen.validate import carried_columns, input_columns, load_tokenizer, validate_job

log = logging.getLogger(__name__)


@dataclass
class Summary:
    totals: Totals
    wall_seconds: float
    manifest: dict[str, Any]
    skipped_parts: int = 0
    already_done: bool = False

    def line(self) -> str:
        if self.already_done:
            return "nothing to do: this job already finished (see _SUCCESS)"
        t = self.totals
        rate = t.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0
        resumed = f" | resumed: {self.skipped_parts} part(s) kept" if self.skipped_parts else ""
        return (
            f"{t.ok_rows} rows ok, {t.error_rows} failed | tokens: {t.input_tokens} in "
            f"({t.cached_tokens} cached), {t.output_tokens} out | {self.wall_seconds:.1f}s, "
            f"{rate:.1f} output tok/s{resumed}"
        )


class JobRunner:
    def __init__(self, spec: JobSpec, quiet: bool = False, overwrite: bool = False) -> None:
        self.spec = spec
        self.quiet = quiet
        self.overwrite = overwrite
        self.duplicates: dict[tuple[int, int], IdProblem] = {}  # (file index, row) -> why its id fails

    def run(self) -> Summary:
        start = time.time()
        files = validate_job(self.spec)  # fails here, before any weights load, on a bad job
        carried = carried_columns(self.spec, files[0].schema)
        add_row_id = self.spec.input.id_column is None
        writer = PartWriter(self.spec.output.path, output_schema([files[0].schema.field(c) for c in carried], add_row_id))
        writer.prepare()
        lock = OutputLock(self.spec.output.path)
        lock.acquire()
        try:
            return self._run_locked(files, carried, writer, start)
        finally:
            lock.release()

    def _run_locked(self, files: list[InputFile], carried: list[str], writer: PartWriter, start: float) -> Summary:
        state = OutputState(self.spec.output.path)
        if self.overwrite:
            state.overwrite()
        fingerprint = job_fingerprint(self.spec, files)
        if state.check_record(fingerprint):
            manifest = json.loads((self.spec.output.path / SUCCESS_NAME).read_text(encoding="utf-8"))
            return Summary(Totals(), 0.0, manifest, already_done=True)
        if state.remove_leftovers():
            log.info("removed temporary files of an interrupted run")
        state.write_record(fingerprint)
        shards = plan_shards(files, self.spec.engine.window_rows, self.spec.input.limit)
        committed = state.committed_parts()
        totals = Totals()
        for index in committed:
            totals.merge(state.totals_of(committed[index]))
        todo = [s for s in shards if s.index not in committed]
        if self.spec.input.id_column is not None and todo:
            self.duplicates = find_duplicate_ids(files, shards, self.spec.input.id_column)
        if committed:
            log.info("resuming: %d of %d parts already committed", len(committed), len(shards))
        self._process(files, carried, writer, todo, totals, start)
        wall = time.time() - start
        manifest = self._manifest(totals, files, shards, start, wall, fingerprint["id"])
        fault_point("before_success")
        writer.write_success(manifest)
        return Summary(totals, wall, manifest, skipped_parts=len(committed))

    def _process(
        self, files: list[InputFile], carried: list[str], writer: PartWriter, todo: list[Shard], totals: Totals,
        start: float,
    ) -> None:
        if not todo:
            return
        tokenizer = load_tokenizer(self.spec.model.path)
        backend = load_backend(self.spec, tokenizer)
        preparer = RowPreparer(self.spec, tokenizer, backend.max_model_len)
        add_row_id = self.spec.input.id_column is None
        with tqdm(total=sum(s.num_rows for s in todo), unit="row", disable=self.quiet, dynamic_ncols=True) as bar:
            for shard, table in read_shards(files, todo, _read_columns(self.spec, carried)):
                f = files[shard.file_index]
                cols = self._run_shard(shard, table, f, backend, preparer, bar)
                row_ids = f.row_ids(shard.start, shard.stop) if add_row_id else None
                writer.write_part(shard.index, part_table(table, carried, row_ids, cols))
                totals.add_part(cols)
                bar.set_postfix(tok_s=f"{totals.output_tokens / max(time.time() - start, 1e-9):.0f}")

    def _run_shard(
        self, shard: Shard, table: pa.Table, f: InputFile, backend: Backend, preparer: RowPreparer, bar: tqdm
    ) -> dict[str, list[Any]]:
        rows = preparer.prepare_shard(f, shard, table, self.duplicates)
        ok = [i for i, r in enumerate(rows) if r.ok]
        bar.update(len(rows) - len(ok))  # error rows are done already
        order = [ok[j] for j in order_requests([rows[i].prompt_ids for i in ok], self.spec.engine.ordering)]

        def on_output(_: RequestOutput) -> None:
            bar.update(1)
            fault_point("mid_engine")
            fault_point("engine_exception")

        try:
            outs = backend.generate([rows[i].prompt_ids for i in order], [rows[i].params for i in order], on_output)
        except BatchgenError:
            raise
        except Exception as exc:
            # Why: the part in flight is abandoned uncommitted; committed parts stay, a rerun resumes.
            raise EngineFailure(f"engine failed on rows {shard.start}-{shard.stop - 1} of {f.path}: {exc}") from exc
        return result_columns(rows, dict(zip(order, outs)))

    def _manifest(
        self, totals: Totals, files: list[InputFile], shards: list[Shard], start: float, wall: float, fingerprint: str
    ) -> dict[str, Any]:
        import torch
        import transformers

        return {
            "rows": {"total": totals.rows, "ok": totals.ok_rows, "error": totals.error_rows},
            "finish_reasons": totals.finish_reasons,
            "error_codes": totals.error_codes,
            "tokens": {"input": totals.input_tokens, "cached": totals.cached_tokens, "output": totals.output_tokens},
            "parts": len(shards),
            "inputs": [str(f.path) for f in files],
            "fingerprint": fingerprint,
            "backend": self.spec.engine.backend,
            "versions": {
                "batchgen": batchgen.__version__,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "pyarrow": pa.__version__,
                "python": platform.python_version(),
            },
            "timings": {
                "started": datetime.fromtimestamp(start, timezone.utc).isoformat(),
                "wall_seconds": round(wall, 3),
                "output_tokens_per_second": round(totals.output_tokens / wall, 2) if wall > 0 else None,
            },
        }


def _read_columns(spec: JobSpec, carried: list[str]) -> list[str]:
    return list(dict.fromkeys(input_columns(spec) + carried))

