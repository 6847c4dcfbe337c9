"""Crash safety in real subprocesses: kill -9 at named points and at random moments, SIGTERM,
the lock, fingerprints. Every input row must end up in the output exactly once, equal to an
uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from click.testing import CliRunner

from batchgen.cli import main
from batchgen.jobstate import OutputLock
from tests.conftest import make_job, write_job, write_parquet

ROWS = 24
WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]


def _job(tmp_path: Path, model: Path, out: Path, rows: int = ROWS, **engine: object) -> Path:
    prompts = [" ".join(WORDS[(i + j) % 10] for j in range(2 + i % 7)) for i in range(rows)]
    data = write_parquet(tmp_path / "in.parquet", {"id": [f"r{i}" for i in range(rows)], "prompt": prompts})
    job = make_job(model, str(data), out, engine={"window_rows": 4, **engine}, sampling={"max_tokens": 6})
    return write_job(tmp_path / f"{out.name}.yaml", job)


def _cli(job: Path, *args: str, fault: str | None = None, wait: bool = True) -> subprocess.Popen | subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "BATCHGEN_FAULT"}
    if fault:
        env["BATCHGEN_FAULT"] = fault
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--quiet", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _rows(out: Path) -> list[tuple[str, str, int]]:
    table = ds.dataset(out, format="parquet").to_table(columns=["id", "generated_text", "output_tokens"])
    return list(zip(*(table.column(c).to_pylist() for c in table.column_names)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[tuple[str, str, int]]:
    tmp = tmp_path_factory.mktemp("ref")
    done = _cli(_job(tmp, tiny_model_dir, tmp / "out"))
    assert done.returncode == 0, done.stderr
    rows = _rows(tmp / "out")
    assert [r[0] for r in rows] == [f"r{i}" for i in range(ROWS)]
    return rows


@pytest.mark.parametrize("point", ["after_temp_write:2", "after_rename:2", "before_success", "mid_engine:9"])
def test_kill_at_a_named_point_then_resume(tmp_path: Path, tiny_model_dir: Path, reference: list, point: str) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out)
    killed = _cli(job, fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "_SUCCESS").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    resumed = _cli(job)
    assert resumed.returncode == 0, resumed.stderr
    assert _rows(out) == reference  # every row exactly once, equal to an uninterrupted run
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in kept.items())  # not recomputed
    assert not list(out.glob(".*.tmp"))
    if kept:
        assert f"resumed: {len(kept)} part(s) kept" in resumed.stdout


def test_random_kill_soak(tmp_path: Path, tiny_model_dir: Path, reference: list) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out)
    rng = random.Random(7)
    for _ in range(2):  # bounded: two kills at random moments, then a clean finish
        proc = _cli(job, wait=False)
        time.sleep(rng.uniform(1.0, 6.0))
        proc.kill()
        proc.communicate(timeout=60)
    final = _cli(job)
    assert final.returncode == 0, final.stderr
    assert _rows(out) == reference


def test_sigterm_stops_cleanly_and_resumes(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out, rows=400)
    proc = _cli(job, wait=False)
    deadline = time.time() + 120
    while not (out / "part-000001.parquet").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "interrupted by SIGTERM" in stderr
    assert not (out / "_SUCCESS").exists() and not list(out.glob(".*.tmp"))
    assert _cli(job).returncode == 0
    assert [r[0] for r in _rows(out)] == [f"r{i}" for i in range(400)]


def _in_process(job: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", *args])
    return result.exit_code, result.output


def test_changed_job_is_refused_and_finished_job_is_a_no_op(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out)
    assert _in_process(job)[0] == 0
    code, text = _in_process(job)
    assert code == 0 and "already finished" in text
    code, text = _in_process(job, "--set", "sampling.max_tokens=5")
    assert code == 2 and "sampling.max_tokens: 6 -> 5" in text
    (tmp_path / "in.parquet").write_bytes((tmp_path / "in.parquet").read_bytes())  # same content: same job
    assert _in_process(job)[0] == 0
    code, text = _in_process(job, "--set", "sampling.max_tokens=5", "--overwrite")
    assert code == 0, text
    assert all(r[2] <= 5 for r in _rows(out))


def test_a_live_run_holds_the_lock(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = _job(tmp_path, tiny_model_dir, out)
    lock = OutputLock(out)
    lock.acquire()
    try:
        blocked = _cli(job)  # another process: flock is per open file, so this must be one
    finally:
        lock.release()
    assert blocked.returncode == 7
    assert f"pid {os.getpid()}" in blocked.stderr
    assert _in_process(job)[0] == 0  # released: the next run goes ahead
