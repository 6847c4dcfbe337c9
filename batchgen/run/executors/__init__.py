"""Where a job's parts run. `executor.kind: local` (the default) is the runner's own loop in this
process; `ray` hands the parts to engine workers on a Ray cluster (ray_executor.py). Both call
`PartWork.process_part` (run/part_work.py), so a part is generated and committed the same way
wherever it runs; the runner hands an executor its PartWork with the parts to do."""

from __future__ import annotations

from typing import Protocol

from batchgen.inputs.dataset import InputFile
from batchgen.inputs.part_rows import Part
from batchgen.job.spec import JobSpec
from batchgen.outputs.parts import PartWriter
from batchgen.outputs.totals import Totals
from batchgen.run.part_work import PartWork


class Executor(Protocol):
    """Runs the parts a job still needs and adds their totals to `totals`."""

    def process(
        self,
        work: PartWork,
        files: list[InputFile],
        carried: list[str],
        writer: PartWriter,
        todo: list[Part],
        totals: Totals,
    ) -> None: ...

    def close(self) -> None: ...


def open_executor(spec: JobSpec, quiet: bool = False) -> Executor | None:
    """None for `kind: local`; for `kind: ray` the Ray executor, connected (or a local instance
    started) now, so that a missing Ray or an unreachable cluster stops the job before any work."""
    if spec.executor.kind == "local":
        return None
    from batchgen.run.executors.ray_executor import RayExecutor

    return RayExecutor(spec.executor, quiet)
