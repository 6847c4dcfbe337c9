"""One part's work: its rows prepared, ordered, generated and committed. The runner's own loop and
every Ray worker do it through `PartWork.process_part`, so a part is generated and committed the
same way wherever it runs; `load_engine` is what each such process loads once for it.

Why apart from the runner: the executors run parts too. The runner hands them its PartWork, and
with it the one thing of the driver a part needs (taking over an --overwritten output just before
the first commit), so the runner and the executors need not import each other.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import pyarrow as pa

from batchgen.backends import load_backend
from batchgen.backends.base import Backend
from batchgen.engine.api.outputs import RequestOutput
from batchgen.errors import BatchgenError, EngineFailure
from batchgen.faults import fault_point
from batchgen.inputs.dataset import InputFile
from batchgen.inputs.duplicate_ids import IdProblem
from batchgen.inputs.ordering import order_requests
from batchgen.inputs.part_rows import PartRows, describe
from batchgen.inputs.prepare import RowPreparer, input_columns, load_tokenizer
from batchgen.inputs.row_names import row_ids
from batchgen.job.spec import JobSpec
from batchgen.outputs.adapter_field import LORA_COLUMN
from batchgen.outputs.parts import PartWriter, part_name
from batchgen.outputs.samples import ColumnPlan
from batchgen.outputs.state import OutputState
from batchgen.outputs.table import INPUT_ROW_COLUMN, RESULT_FIELDS, part_table, result_columns
from batchgen.outputs.totals import Totals
from batchgen.run import interrupt

log = logging.getLogger(__name__)


class OutputHandover(Protocol):
    """The driver's side of --overwrite (JobRunner): whether the old output is still there, and its
    removal, done once, just before this job's first part is committed."""

    @property
    def replacing_output(self) -> bool: ...

    def take_over_output(self) -> None: ...


class PartWork:
    """How each part of a job is generated and committed: the job, the rows whose id fails (judged by
    the driver over the whole job: (file index, row) -> why), and the driver's hand-over of an
    --overwritten output (None on a Ray worker, whose work replaces nothing)."""

    def __init__(
        self,
        spec: JobSpec,
        duplicates: dict[tuple[int, int], IdProblem] | None = None,
        handover: OutputHandover | None = None,
    ) -> None:
        self.spec = spec
        self.duplicates = duplicates if duplicates is not None else {}
        self.handover = handover
        self.columns = ColumnPlan.of(spec)  # n, logprobs, prompt_logprobs shape the result columns
        self.result_fields = self.columns.fields(RESULT_FIELDS)

    @property
    def replacing_output(self) -> bool:
        """--overwrite, and the old output is still there (JobRunner.take_over_output)."""
        return self.handover is not None and self.handover.replacing_output

    def take_over_output(self) -> None:
        if self.handover is not None:
            self.handover.take_over_output()

    def process_part(
        self,
        files: list[InputFile],
        part: PartRows,
        carried: list[str],
        writer: PartWriter,
        backend: Backend,
        preparer: RowPreparer,
        bar: RowCounter,
    ) -> Totals:
        """Generate one part from its rows and commit it; its totals. The runner's own loop and every
        Ray worker call this, so both commit with the same atomic, never-replacing protocol."""
        if not self.replacing_output:  # why before generating: a refused runtime wastes no part's work
            writer.claim_runtime(backend.resolved())
        cols = self._run_part(files, part, backend, preparer, bar)
        ids = row_ids(files, part.file_index, part.file_row) if self.spec.input.id_column is None else None
        if INPUT_ROW_COLUMN in writer.schema.names:  # every output made since prefix grouping
            cols[INPUT_ROW_COLUMN] = part.input_row
        totals = Totals()
        self.take_over_output()
        writer.claim_runtime(backend.resolved())  # (--overwrite: into the new record; else done already)
        index = part.part.index
        if writer.write_part(index, part_table(part.table, carried, ids, cols, self._fields(writer))):
            totals.add_part(cols, LORA_COLUMN if self.columns.lora else None)  # (cols: result columns only)
        else:  # a concurrent shard run of another N (or a replaced Ray worker) committed it first: that part stands
            log.info("part %d was committed by another run meanwhile; kept that one", index)
            totals.merge(OutputState(writer.storage).totals_of(part_name(index), self.columns.lora))
        return totals

    def _fields(self, writer: PartWriter) -> list[pa.Field]:
        if INPUT_ROW_COLUMN in writer.schema.names:
            return [writer.schema.field(INPUT_ROW_COLUMN), *self.result_fields]
        return self.result_fields

    def _run_part(
        self, files: list[InputFile], part: PartRows, backend: Backend, preparer: RowPreparer, bar: RowCounter
    ) -> dict[str, list[Any]]:
        rows = preparer.prepare_part(files, part, self.duplicates)
        if self.spec.task != "generate":  # embed, classify, score: the one branch (run/pooling_work)
            return self._pool_part(files, part, backend, rows, bar)
        requests = {i: r.request() for i, r in enumerate(rows) if r.ok}
        ok = list(requests)
        bar.update(len(rows) - len(ok))  # error rows are done already
        named = [rows[i].adapter for i in ok]
        groups = named if any(named) else None  # each adapter's rows together (ordering prefix, length)
        order = [ok[j] for j in order_requests([requests[i][0] for i in ok], self.spec.engine.ordering, groups)]
        # an image row's images go as LazyImages (size and hash; no pixels, no open file): the
        # engine decodes each in the step that first reaches its tokens and drops the pixels there
        prompts = [rows[i].engine_prompt() for i in order]

        def on_output(out: RequestOutput) -> None:
            interrupt.check()  # between requests' outputs: the part in flight is abandoned uncommitted
            bar.update(1, out.num_output_tokens)
            fault_point("mid_engine")
            fault_point("engine_exception")

        try:
            params = [requests[i][1] for i in order]
            adapters = [rows[i].adapter for i in order] if groups is not None else None
            outs = backend.generate(prompts, params, on_output, adapters)
        except BatchgenError:
            raise
        except Exception as exc:
            # Why: the part in flight is abandoned uncommitted; committed parts stay, a rerun resumes.
            raise EngineFailure(f"engine failed on {describe(part.part, files)}: {exc}") from exc
        self.columns = self.columns.with_tokenizer(preparer.tokenizer)
        return result_columns(rows, dict(zip(order, outs)), self.columns)

    def _pool_part(
        self, files: list[InputFile], part: PartRows, backend: Backend, rows: list[Any], bar: RowCounter
    ) -> dict[str, list[Any]]:
        from batchgen.backends.pooling import PoolingBackend
        from batchgen.run.pooling_work import pooled_columns

        if not isinstance(backend, PoolingBackend):
            raise TypeError(f"task {self.spec.task} needs the pooling backend, got {backend.name}")
        interrupt.check()
        backend.model.on_step = interrupt.check  # between forwards: the part in flight is abandoned uncommitted
        try:
            cols = pooled_columns(self.spec, rows, part.table, backend, self.result_fields)
        except BatchgenError:
            raise
        except Exception as exc:  # as generation's: the part is abandoned uncommitted, a rerun resumes
            raise EngineFailure(f"engine failed on {describe(part.part, files)}: {exc}") from exc
        fault_point("mid_engine")
        interrupt.check()
        bar.update(len(rows))
        return cols


class RowCounter(Protocol):
    """Counts finished rows and their output tokens: the progress bar locally, a reporter to the
    driver's bar on a Ray worker."""

    def update(self, n: int = 1, tokens: int = 0) -> object: ...


def load_engine(spec: JobSpec) -> tuple[Backend, RowPreparer]:
    """The model and the row preparer, loaded once per process (or per Ray worker)."""
    tokenizer = load_tokenizer(spec.model.path)
    backend = load_backend(spec, tokenizer)
    return backend, RowPreparer(spec, tokenizer, backend.max_model_len)


def read_columns(spec: JobSpec, carried: list[str]) -> list[str]:
    """The input columns a part reads: those its requests are made from, then the carried ones."""
    return list(dict.fromkeys(input_columns(spec) + carried))
