"""On the Ray executor, a transient store error that outlasts a worker's own retries is the
store's, not the engine's: the driver hands the part out again and the job finishes with a local
run's rows (before, it ended as an engine failure, exit 6). Its own module: the fault reaches the
workers through the environment Ray starts them with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from batchgen.job.spec import load_job
from batchgen.run.runner import JobRunner
from tests.conftest import make_job, write_job, write_parquet

COLUMNS = ["row_id", "generated_text", "finish_reason", "input_tokens", "output_tokens"]


def _job(tmp_path: Path, model: Path, name: str, ray: bool) -> Path:
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(data, {"prompt": [f"once upon a time {i} the cat" for i in range(12)]})
    job = make_job(model, str(data), tmp_path / name, engine={"window_rows": 3}, sampling={"max_tokens": 4})
    job["input"]["id_column"] = None
    if ray:
        job["executor"] = {"kind": "ray", "num_workers": 2, "worker_cpus": 1}
    return write_job(tmp_path / f"{name}.yaml", job)


def _rows(out: Path) -> list[tuple[Any, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=COLUMNS)
    return sorted(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


@pytest.fixture
def ray_with_fault(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    import ray

    monkeypatch.setenv("BATCHGEN_FAULT", "store_unavailable:1")  # each worker's first part, once
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    monkeypatch.delenv("BATCHGEN_FAULT")  # the workers have it; the driver must not
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_a_part_whose_worker_hit_a_store_outage_is_handed_out_again(
    ray_with_fault: Any, tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    JobRunner(load_job(_job(tmp_path, tiny_model_dir, "local", ray=False)), quiet=True).run()
    runner = JobRunner(load_job(_job(tmp_path, tiny_model_dir, "ray", ray=True)), quiet=True)
    summary = runner.run()
    assert summary.totals.ok_rows == 12
    assert _rows(tmp_path / "ray") == _rows(tmp_path / "local")
    assert sorted(i for parts in runner.executor.stats.parts for i in parts) == [0, 1, 2, 3]  # each once
    assert "failed on a transient store error" in caplog.text
