"""The Ray executor (`executor: {kind: ray}`) on a local Ray instance started once for the module:
two workers give a local run's rows; a worker killed with SIGKILL mid-part is replaced and the
job still has every row once; a job started locally resumes on Ray; Ray missing or no cluster at
`address: auto` stops the job before any work (exit 9). The part queue and the worker plan are
checked without Ray."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchgen import faults
from batchgen.cli import main
from batchgen.errors import EngineFailure, ExecutorError
from batchgen.inputs.dataset import Shard
from batchgen.job.sections import ExecutorSection
from batchgen.job.spec import load_job
from batchgen.outputs.fingerprint import job_fingerprint
from batchgen.outputs.record import RECORD_NAME
from batchgen.outputs.state import SUCCESS_NAME
from batchgen.run.executors.part_queue import PartQueue
from batchgen.run.executors.ray_cluster import plan_workers
from batchgen.run.runner import JobRunner
from batchgen.run.summary import Summary
from batchgen.run.validate import validate_job
from batchgen.storage.local import LocalStorage
from tests.conftest import make_job, write_job, write_parquet

ROWS = 200  # window 20: 10 parts
WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
COLUMNS = ["id", "generated_text", "finish_reason", "error_code", "input_tokens", "output_tokens"]
PREAMBLE = " ".join(WORDS * 4)  # 40 words: whole prefix-cache blocks shared by every prompt
RAY = {"kind": "ray", "num_workers": 2, "worker_cpus": 1}


def _job(tmp_path: Path, model: Path, name: str, executor: dict[str, Any] | None = None) -> Path:
    data = tmp_path / "in.parquet"
    if not data.exists():
        ids = [f"r{i}" for i in range(ROWS)]
        ids[150] = "r5"  # a duplicate id in another part than its first use: judged over the whole job
        # prompts sharing a preamble, so the prefix cache has something to serve
        prompts = [f"{PREAMBLE} {' '.join(WORDS[(i + j) % 10] for j in range(i % 5))}" for i in range(ROWS)]
        write_parquet(data, {"id": ids, "prompt": prompts})
    # grouping none: these tests count parts of 20 rows in input order (grouped parts on Ray:
    # tests/test_prefix_groups.py)
    engine = {"backend": "native", "window_rows": 20}
    job = make_job(model, str(data), tmp_path / name, engine=engine, input={"grouping": "none"})
    job["sampling"]["max_tokens"] = 6
    if executor is not None:
        job["executor"] = executor
    return write_job(tmp_path / f"{name}.yaml", job)


def _rows(out: Path) -> list[tuple[Any, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=COLUMNS)
    return sorted(zip(*(table.column(c).to_pylist() for c in COLUMNS)), key=repr)  # repr: a null beside text


def _run(job: Path) -> tuple[JobRunner, Summary]:
    runner = JobRunner(load_job(job), quiet=True)
    return runner, runner.run()


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a test writes the fault its Ray workers should meet (faults.py: BATCHGEN_FAULT_FILE);
    absent, none. Why a file: the workers start with the module's Ray, before any test sets a fault."""
    return tmp_path_factory.mktemp("faults") / "fault"


@pytest.fixture(scope="module")
def ray_instance(fault_file: Path) -> Iterator[Any]:
    """One local Ray instance for the module (the runner uses a Ray already initialised in its process)."""
    import ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("BATCHGEN_FAULT_FILE", str(fault_file))  # the workers inherit it from the Ray started here
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        yield ray
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[tuple[Any, ...]]:
    tmp = tmp_path_factory.mktemp("local")
    _run(_job(tmp, tiny_model_dir, "out"))
    rows = _rows(tmp / "out")
    assert len(rows) == ROWS and sum(r[3] == "duplicate_id" for r in rows) == 1
    return rows


@pytest.mark.serial  # "auto" would find a Ray that a test in another pytest worker started
def test_address_auto_without_a_cluster_fails_before_any_work(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Why first in the module: "auto" finds any Ray running on this machine, the module's own included.
    job = _job(tmp_path, tiny_model_dir, "out", {"kind": "ray", "address": "auto"})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 9, result.output
    assert "executor.address 'auto': no Ray cluster answers there" in result.output
    assert "ray start --head" in result.output
    out = tmp_path / "out"
    assert not (out / RECORD_NAME).exists() and not LocalStorage(out).committed_parts()


def test_kind_ray_without_ray_installed_names_the_install_command(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path, tiny_model_dir, "out", {"kind": "ray"})
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError, as when it is not installed
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 9, result.output
    assert "pip install 'batchgen[ray]'" in result.output
    out = tmp_path / "out"
    assert not (out / RECORD_NAME).exists() and not LocalStorage(out).committed_parts()


def test_a_finished_job_rerun_on_ray_does_not_reach_ray(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(_job(tmp_path, tiny_model_dir, "out"))
    success = (tmp_path / "out" / SUCCESS_NAME).read_bytes()
    job = _job(tmp_path, tiny_model_dir, "out", {"kind": "ray", "address": "auto"})
    monkeypatch.setitem(sys.modules, "ray", None)  # reaching for Ray at all would fail with exit 9
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    assert "already finished" in result.output
    assert (tmp_path / "out" / SUCCESS_NAME).read_bytes() == success


def test_overwrite_with_ray_unreachable_keeps_the_old_output(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _run(_job(tmp_path, tiny_model_dir, "out"))
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    job = _job(tmp_path, tiny_model_dir, "out", {"kind": "ray"})
    monkeypatch.setitem(sys.modules, "ray", None)
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", "--overwrite"])
    assert result.exit_code == 9, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before  # Ray is reached before anything is deleted


def test_two_ray_workers_give_the_rows_of_a_local_run(
    ray_instance: Any, tmp_path: Path, tiny_model_dir: Path, reference: list[tuple[Any, ...]]
) -> None:
    runner, summary = _run(_job(tmp_path, tiny_model_dir, "out", RAY))
    out = tmp_path / "out"
    assert _rows(out) == reference  # every row once: the same texts, finish reasons, errors and usage
    assert sorted(i for parts in runner.executor.stats.parts for i in parts) == list(range(10))
    usage = ds.dataset(out, format="parquet").to_table(columns=["cached_tokens", "output_tokens"])
    done = summary.manifest
    assert done["rows"] == {"total": ROWS, "ok": ROWS - 1, "error": 1}  # totals summed from the parts
    # cached tokens depend on which parts share a worker's prefix cache, so only their sum is checked
    assert done["tokens"]["cached"] == sum(usage.column("cached_tokens").to_pylist()) > 0
    assert done["tokens"]["output"] == sum(usage.column("output_tokens").to_pylist())


@pytest.mark.slow
def test_a_worker_killed_mid_part_is_replaced_and_every_row_lands_once(
    ray_instance: Any, fault_file: Path, tmp_path: Path, tiny_model_dir: Path, reference: list[tuple[Any, ...]]
) -> None:
    job, out, pause = _job(tmp_path, tiny_model_dir, "out", RAY), tmp_path / "out", tmp_path / "pause"
    pause.mkdir()
    # Each worker counts its own outputs: the 25th is in its second part (20 rows each), after its
    # first commit. The first worker there pauses (the others, a replacement included, go on).
    fault_file.write_text(f"BATCHGEN_FAULT=mid_engine:25\nBATCHGEN_FAULT_PAUSE={pause}\n")
    result: dict[str, Any] = {}
    driver = threading.Thread(target=lambda: result.update(runner=_run(job)[0]), daemon=True)
    driver.start()
    try:
        paused = faults.wait_paused(pause, "mid_engine", driver.is_alive, timeout=240)
        assert LocalStorage(out).committed_parts()  # a part is committed and another under way in `paused`
        os.kill(paused, signal.SIGKILL)  # as the OOM killer would
    finally:
        fault_file.unlink()
    driver.join(timeout=180)
    runner = result["runner"]
    assert runner.executor.stats.replaced == 1
    assert _rows(out) == reference
    assert sorted(i for parts in runner.executor.stats.parts for i in parts) == list(range(10))  # each part once
    assert (out / SUCCESS_NAME).exists() and not list(out.glob(".*.tmp"))


@pytest.mark.slow
def test_a_job_started_locally_resumes_on_ray(
    ray_instance: Any,
    tmp_path: Path,
    tiny_model_dir: Path,
    reference: list[tuple[Any, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local, out = _job(tmp_path, tiny_model_dir, "out"), tmp_path / "out"
    monkeypatch.setenv("BATCHGEN_FAULT", "engine_exception:50")  # the local run fails in its third part
    with pytest.raises(EngineFailure):
        _run(local)
    monkeypatch.delenv("BATCHGEN_FAULT")
    fingerprint = json.loads((out / RECORD_NAME).read_text())["id"]
    assert sorted(LocalStorage(out).committed_parts()) == [0, 1]
    runner, summary = _run(_job(tmp_path, tiny_model_dir, "out", RAY))  # only the executor changed: the same job
    assert summary.skipped_parts == 2
    assert json.loads((out / RECORD_NAME).read_text())["id"] == fingerprint
    assert sorted(i for parts in runner.executor.stats.parts for i in parts) == list(range(2, 10))
    assert _rows(out) == reference


@pytest.mark.slow
def test_overwrite_on_ray_keeps_the_old_output_until_the_workers_load_the_model(
    ray_instance: Any, tmp_path: Path, tiny_model_dir: Path, reference: list[tuple[Any, ...]]
) -> None:
    _run(_job(tmp_path, tiny_model_dir, "out"))
    out = tmp_path / "out"
    before = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".lock")}
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_model_dir, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    job = _job(tmp_path, tiny_model_dir, "out", RAY)
    args = ["run", str(job), "--quiet", "--overwrite"]
    result = CliRunner().invoke(main, [*args, "--set", f"model.path={weightless}"])
    assert result.exit_code == 4 and "weightless" in result.output, result.output
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".lock")} == before
    result = CliRunner().invoke(main, args)  # the same job again, replaced on Ray: the same rows
    assert result.exit_code == 0, result.output
    assert _rows(out) == reference


def test_the_executor_section_is_strict_and_outside_the_fingerprint(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir, "out")
    local = load_job(job)
    ray = load_job(job, ["executor.kind=ray", "executor.num_workers=4", "executor.address=ray://head:10001"])
    files = validate_job(local)
    assert job_fingerprint(local, files) == job_fingerprint(ray, files)
    for bad, why in [
        ("executor.kind=dask", "executor.kind"),
        ("executor.workers=2", "executor.workers: unknown key"),
        ("executor.worker_gpus=2", "executor.worker_gpus"),
        ("executor.address=nowhere", "executor.address: must be null, auto, ray://host:port or host:port"),
    ]:
        result = CliRunner().invoke(main, ["validate", str(job), "--set", bad])
        assert result.exit_code == 2 and why in result.output, (bad, result.output)


def _parts(n: int) -> list[Shard]:
    return [Shard(i, 0, i * 10, i * 10 + 10) for i in range(n)]


def test_each_worker_takes_a_contiguous_run_and_steals_from_the_longest_runs_tail() -> None:
    queue = PartQueue(_parts(10), 2)
    taken = [queue.next_for(0) for _ in range(5)]
    assert [p.index for p in taken if p] == [0, 1, 2, 3, 4]  # worker 0's own run, in order
    assert [p.index for p in (queue.next_for(0), queue.next_for(1), queue.next_for(0))] == [9, 5, 8]
    queue.give_back(1, Shard(5, 0, 50, 60))  # worker 1 died on part 5: its replacement takes it first
    assert queue.next_for(1).index == 5 and len(queue) == 2


def test_worker_plan_from_the_cluster() -> None:
    section = ExecutorSection(kind="ray")
    assert plan_workers(section, {"CPU": 16.0}) == plan_workers(section, {"CPU": 16.0, "GPU": 0.0})
    assert (plan_workers(section, {"CPU": 16.0}).count, plan_workers(section, {"CPU": 16.0}).cpus) == (1, 16.0)
    eight = plan_workers(section, {"CPU": 64.0, "GPU": 8.0})
    assert (eight.count, eight.cpus, eight.gpus) == (8, 1.0, 1)
    halves = plan_workers(ExecutorSection(kind="ray", num_workers=2), {"CPU": 5.0})
    assert (halves.count, halves.cpus, halves.gpus) == (2, 2.0, 0)
    with pytest.raises(ExecutorError, match="do not fit the Ray cluster"):
        plan_workers(ExecutorSection(kind="ray", num_workers=3, worker_cpus=1), {"CPU": 2.0})
