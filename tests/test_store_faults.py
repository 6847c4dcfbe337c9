"""A sharded job on a real S3 API (moto) through a proxy that injects faults (tests/fault_proxy.py):
dropped and reset connections, 500 and 503 answers, delays, and answers cut after the write
happened, at least 50 of them, plus a shard run killed with SIGKILL at a known point (a fault
point, not a timer) and run again. The output must equal a clean local run row for row, with
every part committed once and one `_SUCCESS` naming them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.outputs.parts import part_name
from tests.conftest import make_job, write_job, write_parquet
from tests.fault_proxy import FaultPlan, FaultProxy
from tests.s3_server import moto_s3

WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
ROWS, WINDOW, SHARDS = 12, 2, 3  # six parts; shard 1 owns parts 1 and 4
COLUMNS = ["row_id", "generated_text", "finish_reason", "input_tokens", "cached_tokens", "output_tokens"]


def _job(tmp_path: Path, model: Path, out: str, endpoint: str | None) -> Path:
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(data, {"prompt": [" ".join(WORDS[(i + j) % 10] for j in range(2 + i % 5)) for i in range(ROWS)]})
    job = make_job(model, str(data), Path("unused"), engine={"window_rows": WINDOW}, sampling={"max_tokens": 4})
    job["input"]["id_column"] = None
    job["output"] = {"path": out}
    if endpoint is not None:
        job["output"]["storage_options"] = {"endpoint_override": endpoint, "region": "us-east-1"}
    return write_job(tmp_path / f"job-{abs(hash(out))}.yaml", job)


def _rows(table: Any) -> list[tuple[Any, ...]]:
    return sorted(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_")}
    # Quick retries (the faults are not rate limits) with room for a run of bad luck.
    env.update(OMP_NUM_THREADS="1", BATCHGEN_STORE_BACKOFF="0.02", BATCHGEN_STORE_ATTEMPTS="12")
    if fault:
        env["BATCHGEN_FAULT"] = fault
    return env


def _shard(job: Path, shard: int, fault: str | None = None) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--quiet", "--shard", f"{shard}/{SHARDS}"]
    return subprocess.Popen(cmd, env=_env(fault), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_sharded_job_through_50_store_faults_and_a_kill_equals_a_clean_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    clean = CliRunner().invoke(main, ["run", str(_job(tmp_path, tiny_model_dir, str(tmp_path / "clean"), None))])
    assert clean.exit_code == 0, clean.output
    expected = _rows(ds.dataset(tmp_path / "clean", format="parquet").to_table())
    with moto_s3() as s3:
        plan = FaultPlan(seed=32, rate=0.5, budget=120)
        with FaultProxy((s3["host"], s3["port"]), plan) as proxy:
            job = _job(tmp_path, tiny_model_dir, "s3://outputs/soak", proxy.endpoint)
            # Shard 1 is killed as its first part is serialized, before the put: kill -9 mid-job.
            runs = [_shard(job, i, "after_temp_write:1" if i == 1 else None) for i in range(SHARDS)]
            done = [(run.wait(timeout=300), run.stderr.read() if run.stderr else "") for run in runs]
            assert [code for code, _ in done] == [0, -signal.SIGKILL, 0], done
            again = _shard(job, 1)
            code, err = again.wait(timeout=300), again.stderr.read() if again.stderr else ""
            assert code == 0, err  # its lease entry names a dead process of this host: no wait
            finalized = subprocess.run(
                [sys.executable, "-m", "batchgen", "finalize", "s3://outputs/soak"],
                env={**_env(), "AWS_ENDPOINT_URL": proxy.endpoint},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert finalized.returncode == 0 and "already finalized" in finalized.stdout, finalized.stderr
        faults = dict(plan.counts)
        assert plan.total >= 50, faults
        assert plan.counts["cut"] >= 5, faults  # writes that landed while their answer was lost
        listing = s3["fs"].get_file_info(pafs.FileSelector("outputs/soak"))
        names = sorted(i.base_name for i in listing)
        parts = [n for n in names if n.startswith("part-")]
        assert parts == [part_name(i) for i in range(ROWS // WINDOW)], names  # each part once, no strays
        assert [n for n in names if not n.startswith("part-")] == [".batchgen.lock", "_JOB.json", "_SUCCESS"], names
        with s3["fs"].open_input_stream("outputs/soak/_SUCCESS") as stream:
            manifest = json.loads(stream.read())
        assert manifest["rows"]["total"] == ROWS and manifest["parts"] == ROWS // WINDOW
        got = _rows(ds.dataset("outputs/soak", format="parquet", filesystem=s3["fs"]).to_table())
    assert got == expected  # row for row, usage included
    print(f"injected faults: {faults}")
