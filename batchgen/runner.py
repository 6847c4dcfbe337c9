"""The job lifecycle: plan shards, then for each one read, prepare, order, generate, commit;
then the `_SUCCESS` manifest and a summary."""

from __future__ import annotations

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
from batchgen.fingerprint import job_fingerprint
from batchgen.job import JobSpec
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

    def line(self) -> str:
        t = self.totals
        rate = t.output_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0
        return (
            f"{t.ok_rows} rows ok, {t.error_rows} failed | tokens: {t.input_tokens} in "
            f"({t.cached_tokens} cached), {t.output_tokens} out | {self.wall_seconds:.1f}s, "
            f"{rate:.1f} output tok/s"
        )


class JobRunner:
    def __init__(self, spec: JobSpec, quiet: bool = False) -> None:
        self.spec = spec
        self.quiet = quiet

    def run(self) -> Summary:
        start = time.time()
        files = validate_job(self.spec)  # fails here, before any weights load, on a bad job
        carried = carried_columns(self.spec, files[0].schema)
        tokenizer = load_tokenizer(self.spec.model.path)
        shards = plan_shards(files, self.spec.engine.window_rows, self.spec.input.limit)
        add_row_id = self.spec.input.id_column is None
        writer = PartWriter(self.spec.output.path, output_schema([files[0].schema.field(c) for c in carried], add_row_id))
        writer.prepare()
        backend = load_backend(self.spec, tokenizer)
        preparer = RowPreparer(self.spec, tokenizer, backend.max_model_len)
        totals = Totals()
        total_rows = sum(s.num_rows for s in shards)
        with tqdm(total=total_rows, unit="row", disable=self.quiet, dynamic_ncols=True) as bar:
            for shard, table in read_shards(files, shards, _read_columns(self.spec, carried)):
                cols = self._run_shard(shard, table, files[shard.file_index], backend, preparer, bar)
                row_ids = _row_ids(files[shard.file_index], shard) if add_row_id else None
                writer.write_part(shard.index, part_table(table, carried, row_ids, cols))
                totals.add_part(cols)
                bar.set_postfix(tok_s=f"{totals.output_tokens / max(time.time() - start, 1e-9):.0f}")
        wall = time.time() - start
        manifest = self._manifest(totals, files, shards, start, wall, backend)
        writer.write_success(manifest)
        return Summary(totals=totals, wall_seconds=wall, manifest=manifest)

    def _run_shard(
        self, shard: Shard, table: pa.Table, f: InputFile, backend: Backend, preparer: RowPreparer, bar: tqdm
    ) -> dict[str, list[Any]]:
        labels = _labels(self.spec, f, shard, table)
        rows = preparer.prepare(table, labels)
        ok = [i for i, r in enumerate(rows) if r.ok]
        bar.update(len(rows) - len(ok))  # error rows are done already
        order = [ok[j] for j in order_requests([rows[i].prompt_ids for i in ok], self.spec.engine.ordering)]

        def on_output(_: RequestOutput) -> None:
            bar.update(1)

        outs = backend.generate([rows[i].prompt_ids for i in order], [rows[i].params for i in order], on_output)
        return result_columns(rows, dict(zip(order, outs)))

    def _manifest(
        self, totals: Totals, files: list[InputFile], shards: list[Shard], start: float, wall: float, backend: Backend
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
            "fingerprint": job_fingerprint(self.spec, files),
            "backend": backend.name,
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


def _row_ids(f: InputFile, shard: Shard) -> list[str]:
    return [f"{f.path.name}:{i}" for i in range(shard.start, shard.stop)]


def _labels(spec: JobSpec, f: InputFile, shard: Shard, table: pa.Table) -> list[str]:
    base = [f"{f.path} row {i}" for i in range(shard.start, shard.stop)]
    if spec.input.id_column is None:
        return base
    ids = table.column(spec.input.id_column).to_pylist()
    return [f"{b} (id {v})" for b, v in zip(base, ids)]

