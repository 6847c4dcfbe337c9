"""Crash safety in real subprocesses: kill -9 at named points and at random moments, SIGTERM,
the lock, fingerprints. Every input row must end up in the output exactly once, equal to an
uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchgen import faults
from batchgen.cli import main
from batchgen.outputs.state import OutputLock
from tests.conftest import make_job, output_table, write_job, write_parquet

ROWS = 24
WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]


BACKENDS = ["hf", "native"]


def _job(tmp_path: Path, model: Path, out: Path, rows: int = ROWS, backend: str = "hf", **engine: object) -> Path:
    prompts = [" ".join(WORDS[(i + j) % 10] for j in range(2 + i % 7)) for i in range(rows)]
    data = write_parquet(tmp_path / "in.parquet", {"id": [f"r{i}" for i in range(rows)], "prompt": prompts})
    job = make_job(
        model, str(data), out, engine={"window_rows": 4, "backend": backend, **engine}, sampling={"max_tokens": 6}
    )
    return write_job(tmp_path / f"{out.name}.yaml", job)


def _cli(
    job: Path,
    *args: str,
    fault: str | None = None,
    wait: bool = True,
    fault_signal: str | None = None,
    pause: Path | None = None,
) -> subprocess.Popen | subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_FAULT")}
    if fault:
        env["BATCHGEN_FAULT"] = fault
    if fault_signal:
        env["BATCHGEN_FAULT_SIGNAL"] = fault_signal
    if pause:
        env["BATCHGEN_FAULT_PAUSE"] = str(pause)
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--quiet", *args]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _rows(out: Path) -> list[tuple[str, str, int]]:
    table = output_table(out, ["id", "generated_text", "output_tokens"])
    return list(zip(*(table.column(c).to_pylist() for c in table.column_names)))


class _References(dict):  # type: ignore[type-arg]
    """An uninterrupted run's rows per backend, computed on first use."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, model: Path) -> None:
        super().__init__()
        self.tmp_path_factory, self.model = tmp_path_factory, model

    def __missing__(self, backend: str) -> list[tuple[str, str, int]]:
        tmp = self.tmp_path_factory.mktemp(f"ref-{backend}")
        # in this process: the reference needs no process of its own (no torch import in a fresh one)
        done = CliRunner().invoke(main, ["run", str(_job(tmp, self.model, tmp / "out", backend=backend)), "--quiet"])
        assert done.exit_code == 0, done.output
        rows = _rows(tmp / "out")
        assert [r[0] for r in rows] == [f"r{i}" for i in range(ROWS)]
        self[backend] = rows
        return rows


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> _References:
    return _References(tmp_path_factory, tiny_model_dir)


# The runner's own points fire after the engine has returned a part, whichever backend made it: one
# backend covers them; the engine's point runs on each.
KILL_POINTS = [
    *((point, "native") for point in ("after_temp_write:2", "after_rename:2", "before_success")),
    *(("mid_engine:9", backend) for backend in BACKENDS),
]


@pytest.mark.slow
@pytest.mark.parametrize(("point", "backend"), KILL_POINTS)
def test_kill_at_a_named_point_then_resume(
    tmp_path: Path, tiny_model_dir: Path, references: _References, point: str, backend: str
) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out, backend=backend)
    killed = _cli(job, fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "_SUCCESS").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    resumed = _cli(job)
    assert resumed.returncode == 0, resumed.stderr
    assert _rows(out) == references[backend]  # every row exactly once, equal to an uninterrupted run
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in kept.items())  # not recomputed
    assert not list(out.glob(".*.tmp"))
    if kept:
        assert f"resumed: {len(kept)} part(s) kept" in resumed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_kill_soak(tmp_path: Path, tiny_model_dir: Path, references: _References, backend: str) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out, backend=backend)
    rng = random.Random(7)
    for _ in range(2):  # bounded: two kills at random moments, then a clean finish
        proc = _cli(job, wait=False)
        time.sleep(rng.uniform(1.0, 6.0))
        proc.kill()
        proc.communicate(timeout=60)
    final = _cli(job)
    assert final.returncode == 0, final.stderr
    assert _rows(out) == references[backend]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_cleanly_and_resumes(
    tmp_path: Path, tiny_model_dir: Path, references: _References, signum: int, backend: str
) -> None:
    """A signal from outside, sent while the run is paused right after its second commit (a fault
    point: the run cannot finish first), then let go: no temp file, 128 + signal, resume."""
    out, pause = tmp_path / "out", tmp_path / "pause"
    pause.mkdir()
    job = _job(tmp_path, tiny_model_dir, out, backend=backend)
    proc = _cli(job, fault="after_rename:2", pause=pause, wait=False)
    assert faults.wait_paused(pause, "after_rename", lambda: proc.poll() is None, timeout=240) == proc.pid
    assert (out / "part-000001.parquet").exists() and not (out / "part-000002.parquet").exists()
    proc.send_signal(signum)
    faults.resume(pause, "after_rename")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    assert not (out / "_SUCCESS").exists() and not list(out.glob(".*.tmp"))
    assert sorted(p.name for p in out.glob("part-*")) == ["part-000000.parquet", "part-000001.parquet"]
    resumed = _cli(job)
    assert resumed.returncode == 0 and "resumed: 2 part(s) kept" in resumed.stdout, resumed.stderr
    assert _rows(out) == references[backend]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "signame", "backend"),
    [
        ("after_temp_write:2", "SIGTERM", "hf"),  # inside a part's write, between fsync and rename
        ("after_temp_write:2", "SIGINT", "native"),
        ("mid_engine:5", "SIGTERM", "native"),  # between two requests' outputs
        ("record_temp_write", "SIGINT", "hf"),  # inside the job record's write
        ("success_temp_write", "SIGTERM", "native"),  # inside _SUCCESS's write: the job is done
    ],
)
def test_a_signal_inside_a_write_never_leaves_a_temp_file(
    tmp_path: Path, tiny_model_dir: Path, references: _References, point: str, signame: str, backend: str
) -> None:
    """The signal lands at an exact line (the process sends it to itself): the write in flight
    completes, the run stops at the next clean point, and a rerun finishes (the kill tests
    cover resuming after the other points)."""
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out, backend=backend)
    stopped = _cli(job, fault=point, fault_signal=signame)
    assert not list(out.glob(".*.tmp")), stopped.stderr
    if point == "success_temp_write":  # all parts and _SUCCESS committed: nothing left to stop
        assert stopped.returncode == 0 and (out / "_SUCCESS").exists(), stopped.stderr
        assert _rows(out) == references[backend]
    else:
        assert stopped.returncode == 128 + signal.Signals[signame], stopped.stderr
        assert not (out / "_SUCCESS").exists()
    if point.startswith("after_temp_write"):  # the part being written: committed once, never twice
        resumed = _cli(job)
        assert resumed.returncode == 0, resumed.stderr
        assert _rows(out) == references[backend]


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_users_hidden_tmp_file_outlives_a_signal_and_the_resume(
    tmp_path: Path, tiny_model_dir: Path, references: _References, signame: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".notes.tmp").write_text("mine")
    job = _job(tmp_path, tiny_model_dir, out)
    stopped = _cli(job, fault="after_temp_write:2", fault_signal=signame)
    assert stopped.returncode == 128 + signal.Signals[signame], stopped.stderr
    assert [p.name for p in out.glob(".*.tmp")] == [".notes.tmp"]
    resumed = _cli(job)
    assert resumed.returncode == 0, resumed.stderr
    assert _rows(out) == references["hf"]
    assert (out / ".notes.tmp").read_text() == "mine"


@pytest.mark.slow
def test_a_signal_during_an_overwrite_keeps_the_old_output(tmp_path: Path, tiny_model_dir: Path) -> None:
    """SIGTERM while --overwrite generates its first part: the old output is untouched, exit 143."""
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out, backend="native")
    assert _cli(job).returncode == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".lock")}
    args = ("--overwrite", "--set", "sampling.max_tokens=5")
    stopped = _cli(job, *args, fault="mid_engine:3", fault_signal="SIGTERM")
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".lock")} == before
    assert "already finished" in _cli(job).stdout


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
    code, text = _in_process(job, "--set", "engine.compile=true")  # a speed setting: the same job
    assert code == 0 and "already finished" in text, text
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


_HEAVY_IMPORTS = """
import sys
from batchgen.cli import main
try:
    main(sys.argv[1:])
except SystemExit as done:
    print("exit", done.code, [m for m in ("torch", "transformers") if m in sys.modules], file=sys.stderr)
"""


def _run_counting_imports(job: Path) -> tuple[str, str]:
    cmd = [sys.executable, "-c", _HEAVY_IMPORTS, "run", str(job), "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return done.stdout, done.stderr.strip().splitlines()[-1]


def test_a_finished_or_locked_job_is_answered_without_torch_or_transformers(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A finished job ("nothing to do") and a held lock need no model: answered before torch and transformers
    are imported (seconds and half a GB saved on every cron tick of a finished job)."""
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out)
    assert _in_process(job)[0] == 0
    stdout, last = _run_counting_imports(job)
    assert "already finished" in stdout and last == "exit 0 []", last
    lock = OutputLock(out)
    lock.acquire()
    try:
        _, last = _run_counting_imports(job)
    finally:
        lock.release()
    assert last == "exit 7 []", last
    moved = tmp_path / "moved-model"
    shutil.copytree(tiny_model_dir, moved)
    spec = yaml.safe_load(job.read_text())
    spec["model"]["path"] = str(moved)
    moved_job = write_job(tmp_path / "moved.yaml", spec)
    shutil.rmtree(moved)  # the model folder is gone: a model problem (exit 4), not "a different job"
    code, text = _in_process(moved_job)
    assert code == 4 and f"model.path {moved}: no such folder" in text, text


@pytest.mark.slow
def test_after_a_resume_the_rate_counts_this_runs_tokens_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    job = _job(tmp_path, tiny_model_dir, out)
    assert _cli(job, fault="after_rename:3").returncode == -signal.SIGKILL  # 3 of 6 parts kept
    kept = sum(sum(pq.read_table(p, columns=["output_tokens"]).column(0).to_pylist()) for p in out.glob("part-*"))
    resumed = _cli(job)
    assert resumed.returncode == 0, resumed.stderr
    match = re.search(r"(\d+) out \| [\d.]+s, ([\d.]+) output tok/s \| resumed: 3 part", resumed.stdout)
    assert match, resumed.stdout
    timings = json.loads((out / "_SUCCESS").read_text())["timings"]
    this_run = int(match.group(1)) - kept
    assert kept > 0 and this_run > 0
    assert abs(float(match.group(2)) - this_run / timings["wall_seconds"]) < 0.1
    assert abs(timings["output_tokens_per_second"] - this_run / timings["wall_seconds"]) < 0.1
