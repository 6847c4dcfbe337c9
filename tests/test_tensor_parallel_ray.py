"""Tensor-parallel workers on Ray (a local instance, CPU): each replica in its own placement group,
the rows of a local TP=1 run, and a rank that dies takes its worker group down: the part is handed
to a new worker (a new group, in the same placement group) once, and every row lands once."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest

from batchgen import faults
from batchgen.job.spec import load_job
from batchgen.outputs.state import SUCCESS_NAME
from batchgen.run.runner import JobRunner
from batchgen.storage.local import LocalStorage
from tests.conftest import make_job, write_job, write_parquet

ROWS = 40  # window 10: 4 parts
COLUMNS = ["id", "generated_text", "finish_reason", "input_tokens", "output_tokens"]
WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
RAY_TP = {"kind": "ray", "num_workers": 1, "worker_cpus": 1, "worker_gpus": 2}


def _job(tmp_path: Path, model: Path, name: str, tp: int, executor: dict[str, Any] | None = None) -> Path:
    data = tmp_path / "in.parquet"
    if not data.exists():
        prompts = [" ".join(WORDS[(i + j) % 10] for j in range(3 + i % 9)) for i in range(ROWS)]
        write_parquet(data, {"id": [f"r{i:02d}" for i in range(ROWS)], "prompt": prompts})
    engine = {"backend": "native", "window_rows": 10, "tensor_parallel_size": tp, "compile": False}
    job = make_job(model, str(data), tmp_path / name, engine=engine, sampling={"max_tokens": 6})
    if executor is not None:
        job["executor"] = executor
    return write_job(tmp_path / f"{name}.yaml", job)


def _rows(out: Path) -> list[tuple[Any, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=COLUMNS).sort_by("id")
    return list(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


def _run(job: Path) -> JobRunner:
    runner = JobRunner(load_job(job), quiet=True)
    runner.run()
    return runner


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("faults") / "fault"


@pytest.fixture(scope="module")
def ray_instance(fault_file: Path) -> Iterator[Any]:
    import ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATCHGEN_FAULT_FILE", str(fault_file))  # Ray's workers, and their ranks, inherit it
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        yield ray
        ray.shutdown()


@pytest.mark.slow
def test_a_rank_killed_on_ray_retries_its_part_once_in_a_new_group(
    ray_instance: Any, fault_file: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    _run(_job(tmp_path, tiny_model_dir, "local", 1))
    reference = _rows(tmp_path / "local")
    job, out, pause = _job(tmp_path, tiny_model_dir, "out", 2, RAY_TP), tmp_path / "out", tmp_path / "pause"
    pause.mkdir()
    # rank 1 pauses before its 12th step (in the second part); killed there, as the OOM killer would
    fault_file.write_text(f"BATCHGEN_FAULT=tp_rank_step:12\nBATCHGEN_FAULT_PAUSE={pause}\n")
    result: dict[str, Any] = {}
    driver = threading.Thread(target=lambda: result.update(runner=_run(job)), daemon=True)
    driver.start()
    try:
        paused = faults.wait_paused(pause, "tp_rank_step", driver.is_alive, timeout=240)
        assert LocalStorage(out).committed_parts()  # one part committed, another under way
        groups = ray_instance.util.placement_group_table()
        assert [g["strategy"] for g in groups.values() if g["state"] == "CREATED"] == ["STRICT_PACK"]
        os.kill(paused, signal.SIGKILL)
    finally:
        fault_file.unlink()
    driver.join(timeout=240)
    runner = result["runner"]
    assert runner.executor.stats.replaced == 1
    assert _rows(out) == reference
    assert sorted(i for parts in runner.executor.stats.parts for i in parts) == list(range(4))  # each part once
    assert (out / SUCCESS_NAME).exists()
    assert not [g for g in ray_instance.util.placement_group_table().values() if g["state"] == "CREATED"]
