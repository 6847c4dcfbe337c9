"""The command line as cron, Airflow and a shell pipeline see it, in real subprocesses: `--quiet`
prints errors and the summary line only, and a closed stdout ends the command quietly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import make_job, write_job, write_parquet


def _batchgen(*args: str, **kwargs: object) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATCHGEN_FAULT", "TRANSFORMERS_", "HF_HUB_"))}
    return subprocess.run([sys.executable, "-m", "batchgen", *args], check=False, env=env, timeout=300, **kwargs)  # type: ignore[call-overload]


def test_quiet_prints_errors_and_the_summary_line_only(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 256  # a too-long prompt makes transformers warn about "indexing errors"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    prompts = ["once upon a time", "the cat " * 300, "a little dog"]
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a", "b", "c"], "prompt": prompts})
    job = write_job(tmp_path / "job.yaml", make_job(model, str(data), tmp_path / "out", sampling={"max_tokens": 3}))
    done = _batchgen("run", str(job), "--quiet", capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # no "Loading weights" bar, no "Token indices sequence length" warning
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("batchgen: 2 rows ok, 1 failed"), done.stdout


def test_a_closed_stdout_ends_quietly(tmp_path: Path) -> None:
    table = pa.table(
        {
            "category": [str(i) for i in range(500)],
            "finish_reason": ["stop"] * 500,
            "error_code": pa.array([None] * 500, pa.string()),
            "input_tokens": [3] * 500,
            "cached_tokens": [0] * 500,
            "output_tokens": [2] * 500,
        }
    )
    pq.write_table(table, tmp_path / "part-000000.parquet")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line, as after `| head -0`
    try:
        done = _batchgen("report", str(tmp_path), "--by", "category", stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert done.stderr == ""  # no BrokenPipeError traceback
    assert done.returncode == 128 + signal.SIGPIPE


def test_doctor_reports_the_attention_backend_auto_picks_and_the_triton_it_would_use() -> None:
    """What a user pastes into a bug report: without CUDA, auto is the CPU backend; triton is named
    by its installed version (read without importing it), or `not installed`."""
    import importlib.metadata

    done = subprocess.run(
        [sys.executable, "-m", "batchgen", "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["attention_backend"] == "cpu"
    try:
        installed: str | None = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert facts["triton"] == installed
