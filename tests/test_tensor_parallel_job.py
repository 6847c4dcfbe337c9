"""`batchgen run` with engine.tensor_parallel_size: 2 on the demo model (CPU, gloo), as a real process.

The same rows as TP=1; a rank killed mid-run ends the job with the engine-failure exit (6), the
committed parts are kept and a rerun finishes with every row exactly once; SIGTERM and a SIGKILL
of rank 0 leave no worker behind. Workers are found by a marker in their inherited environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pyarrow.dataset as ds
import pytest

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["id", "generated_text", "finish_reason", "input_tokens", "cached_tokens", "output_tokens"]
EXIT_ENGINE_FAILURE = 6


def _processes_with(marker: str) -> list[int]:
    """Pids of living processes whose environment holds `marker` (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry))
    return found


def _run(out: Path, tp: int, marker: str, **fault: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_FAULT")}
    env.update({f"BATCHGEN_FAULT{k}": v for k, v in fault.items()}, BATCHGEN_TEST_MARK=marker)
    cmd = [sys.executable, "-m", "batchgen", "run", str(REPO / "jobs/quickstart.yaml"), "--quiet", *_sets(out, tp)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def _sets(out: Path, tp: int) -> list[str]:
    """The --set arguments of every run here: 16 rows, 16 tokens, windows of 4, `tp` ranks."""
    sets = [
        f"output.path={out}",
        "input.limit=16",
        "sampling.max_tokens=16",
        "engine.window_rows=4",
        f"engine.tensor_parallel_size={tp}",
        "engine.compile=false",
    ]
    return [a for s in sets for a in ("--set", s)]


def _rows(out: Path) -> list[tuple[object, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=COLUMNS).sort_by("id")
    return list(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


def _gone(marker: str, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while _processes_with(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[object, ...]]:
    """The TP=1 rows, run in this process: the reference is not under test (no torch import in a fresh process)."""
    from click.testing import CliRunner

    from batchgen.cli import main

    out = tmp_path_factory.mktemp("tp1") / "out"
    done = CliRunner().invoke(main, ["run", str(REPO / "jobs/quickstart.yaml"), "--quiet", *_sets(out, 1)])
    assert done.exit_code == 0, done.output
    return _rows(out)


@pytest.mark.slow
def test_tp2_job_equals_tp1_and_a_killed_rank_resumes_exactly_once(
    tmp_path: Path, reference: list[tuple[object, ...]]
) -> None:
    marker = uuid.uuid4().hex
    whole = _run(tmp_path / "whole", 2, marker)
    assert whole.returncode == 0, whole.stderr
    assert _rows(tmp_path / "whole") == reference  # text and usage, row for row
    assert _gone(marker, 0.0)

    out = tmp_path / "killed"
    killed = _run(out, 2, marker, **{"": "tp_rank_step:40"})  # rank 1 SIGKILLed before its 40th step
    assert killed.returncode == EXIT_ENGINE_FAILURE, killed.stderr
    assert "tensor parallel rank 1" in killed.stderr and f"code {-signal.SIGKILL}" in killed.stderr
    assert _gone(marker, 0.0)
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert 0 < len(kept) < 4, killed.stderr  # some parts committed before the kill, not all
    resumed = _run(out, 2, marker)
    assert resumed.returncode == 0, resumed.stderr
    # every row exactly once; cached_tokens aside (a resumed run starts with a cold prefix cache)
    assert [r[:4] + r[5:] for r in _rows(out)] == [r[:4] + r[5:] for r in reference]
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in kept.items())  # not recomputed


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
def test_rank0_stopped_by_a_signal_leaves_no_worker(tmp_path: Path, signame: str) -> None:
    """SIGTERM: the run stops at its next clean point (exit 128 + 15); SIGKILL: rank 0 vanishes at
    once and its worker, blocked on the pipe or in a collective, exits by itself."""
    marker = uuid.uuid4().hex
    fault = {"": "mid_engine:3"} | ({"_SIGNAL": signame} if signame != "SIGKILL" else {})
    stopped = _run(tmp_path / "out", 2, marker, **fault)
    assert stopped.returncode in (-signal.SIGKILL, 128 + signal.SIGTERM), stopped.stderr
    assert stopped.returncode == (-signal.SIGKILL if signame == "SIGKILL" else 128 + signal.SIGTERM)
    assert _gone(marker), _processes_with(marker)


@pytest.mark.parametrize(
    ("sets", "why"),
    [
        (["engine.tensor_parallel_size=0"], "engine.tensor_parallel_size"),
        (["engine.tensor_parallel_size=2", "engine.backend=hf"], "needs engine.backend native"),
        (["engine.tensor_parallel_size=2", "executor.kind=ray"], "must equal engine.tensor_parallel_size (2)"),
        (["executor.worker_gpus=4", "engine.tensor_parallel_size=2"], "executor.worker_gpus: 4 GPUs"),
    ],
)
def test_tensor_parallel_job_settings_are_checked_before_any_work(sets: list[str], why: str) -> None:
    from click.testing import CliRunner

    from batchgen.cli import main

    args = ["validate", str(REPO / "jobs/quickstart.yaml"), *[a for s in sets for a in ("--set", s)]]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and why in result.output, result.output
