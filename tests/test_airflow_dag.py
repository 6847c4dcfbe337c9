"""The Airflow example under a real Airflow 3: `airflow dags test` runs examples/airflow/batchgen_dag.py
(its @dag/@task wiring, the mapped shard tasks, finalize, report) on a 3-shard job of the tiny model,
and the output must equal a plain run's. Airflow lives in its own venv (`make airflow`, which
`make test` runs first; see the Makefile for why), as it is deployed: the DAG's tasks call batchgen's
command line, here this venv's. Skipped where that venv is missing, except in CI, where it fails."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import pytest

from tests.conftest import make_job, write_job, write_parquet

ROOT = Path(__file__).resolve().parent.parent
AIRFLOW = Path(os.environ.get("BATCHGEN_AIRFLOW_VENV", ROOT / ".venv-airflow")) / "bin" / "airflow"
DAG = ROOT / "examples" / "airflow" / "batchgen_dag.py"
ROWS = 24  # window 4: 6 or more parts over 3 shards
WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
PREAMBLE = " ".join(WORDS * 4)  # whole shared prefix-cache blocks, so cached_tokens means something
SAME = ["id", "generated_text", "finish_reason", "error_code", "input_tokens", "output_tokens"]


def _job(tmp_path: Path, model: Path, name: str) -> tuple[Path, Path]:
    data = tmp_path / "in.parquet"
    if not data.exists():
        prompts = [f"{PREAMBLE} {' '.join(WORDS[(i + j) % 10] for j in range(1 + i % 6))}" for i in range(ROWS)]
        write_parquet(data, {"id": [f"r{i}" for i in range(ROWS)], "prompt": prompts})
    out = tmp_path / name
    engine = {"backend": "native", "window_rows": 4, "block_size": 16}
    return write_job(tmp_path / f"{name}.yaml", make_job(model, str(data), out, engine=engine)), out


def _rows(out: Path) -> list[tuple[object, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=SAME)
    return sorted(zip(*(table.column(c).to_pylist() for c in SAME)))


def _airflow(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(AIRFLOW), *args], env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_airflow_dags_test_runs_the_example_dag_on_three_shards(tmp_path: Path, tiny_model_dir: Path) -> None:
    if not AIRFLOW.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{AIRFLOW} is missing: `make airflow` (run by `make test`) did not install Airflow")
        pytest.skip(f"no Airflow venv at {AIRFLOW.parent.parent} (`make airflow` creates it)")
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(DAG, dags)  # as a user deploys it: the file alone in a DAGs folder
    job, out = _job(tmp_path, tiny_model_dir, "out")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHGEN_", "AIRFLOW", "VIRTUAL_ENV"))}
    env.update(
        AIRFLOW_HOME=str(tmp_path / "airflow"),
        AIRFLOW__CORE__DAGS_FOLDER=str(dags),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        BATCHGEN_JOB=str(job),
        BATCHGEN_OUTPUT=str(out),
        BATCHGEN_SHARDS="3",
        BATCHGEN_COMMAND=shlex.join([sys.executable, "-m", "batchgen"]),
        OMP_NUM_THREADS="1",
    )
    migrated = _airflow("db", "migrate", env=env)
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    done = _airflow("dags", "test", "batchgen_sharded", env=env)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-5000:]
    assert "DagRun Finished: dag_id=batchgen_sharded" in log and "state=success" in log, log[-5000:]
    # a shard takes consecutive runs of whole prefix groups (README: static shards), so its row count
    # follows the plan; together the three take every row once, none failed
    counts = {int(i): int(n) for i, n in re.findall(r"shard (\d)/3: (\d+) rows ok, 0 failed", log)}
    assert sorted(counts) == [0, 1, 2] and sum(counts.values()) == ROWS, log[-5000:]
    assert "totals match _SUCCESS" in log  # the report task's JSON (its XCom)
    plain_job, plain = _job(tmp_path, tiny_model_dir, "plain")
    ran = subprocess.run([sys.executable, "-m", "batchgen", "run", str(plain_job), "--quiet"], env=env, timeout=300)
    assert ran.returncode == 0
    assert _rows(out) == _rows(plain)  # every row once; cached_tokens aside (README: under shards)
    sharded, whole = json.loads((out / "_SUCCESS").read_text()), json.loads((plain / "_SUCCESS").read_text())
    # parts of the prefix plan: at most 4 rows, at least 2, the same in every run of the job
    assert sharded["rows"] == whole["rows"] and 6 <= sharded["parts"] == whole["parts"] <= 12
    assert 0 < sharded["tokens"]["cached"] <= whole["tokens"]["cached"]
