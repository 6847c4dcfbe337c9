"""A resumed output keeps the dtype its record holds: `dtype: auto` resolves to it, so a host whose
auto now resolves to bf16 (dtype_rule) finishes a half-done float32 output in float32; and the job's
validate, estimate and first log line say what auto resolves to and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from batchgen import faults
from batchgen.backends.native import NativeBackend
from batchgen.cli import main
from batchgen.engine.api.dtype_rule import FLAGS_ENV
from testkit.tiny_models import save_random_model, tiny_configs
from tests.conftest import make_job, write_job, write_parquet
from tests.test_part_checks import _job, _record, _run

NATIVE, AVX2 = "avx2 avx512_bf16", "avx2 fma"


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(tiny_configs()["llama"], tmp_path_factory.mktemp("llama-bf16"), dtype=torch.bfloat16)


def test_a_resume_keeps_the_records_dtype(tmp_path: Path, bf16_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job, out = _job(tmp_path, bf16_model)
    monkeypatch.setenv(FLAGS_ENV, AVX2)  # started where bf16 is emulated: float32
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("BATCHGEN_FAULT", "engine_exception:9")
    assert _run(job)[0] == 6
    monkeypatch.delenv("BATCHGEN_FAULT")
    assert [r["dtype"] for r in _record(out)["runtimes"]] == ["float32"]
    monkeypatch.setenv(FLAGS_ENV, NATIVE)  # resumed where auto would now be bf16
    code, text = _run(job)
    assert code == 0 and "mixed runtimes" not in text, text
    assert [r["dtype"] for r in json.loads((out / "_SUCCESS").read_text())["runtimes"]] == ["float32"]


def test_a_new_output_on_a_native_host_runs_in_bf16(
    tmp_path: Path, bf16_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    job, out = _job(tmp_path, bf16_model)
    monkeypatch.setenv(FLAGS_ENV, NATIVE)
    caplog.set_level("INFO", logger="batchgen.run.runner")
    assert _run(job)[0] == 0
    assert [r["dtype"] for r in _record(out)["runtimes"]] == ["bfloat16"]
    assert "dtype auto -> bfloat16 (checkpoint stored in bfloat16" in caplog.text


def test_another_dtype_is_refused_naming_the_pin(
    tmp_path: Path, bf16_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, _ = _job(tmp_path, bf16_model)
    monkeypatch.setenv(FLAGS_ENV, AVX2)
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("BATCHGEN_FAULT", "engine_exception:9")
    assert _run(job)[0] == 6
    monkeypatch.delenv("BATCHGEN_FAULT")
    gpu = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "torch"}
    monkeypatch.setattr(NativeBackend, "resolved", lambda self: gpu)  # as if auto now resolved on a GPU
    code, text = _run(job)
    assert code == 2 and "`model.dtype: float32` pins one precision" in text, text


def test_validate_and_estimate_say_what_auto_resolves_to(
    tmp_path: Path, bf16_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, _ = _job(tmp_path, bf16_model)
    monkeypatch.setenv(FLAGS_ENV, NATIVE)
    validated = CliRunner().invoke(main, ["validate", str(job)])
    assert validated.exit_code == 0
    assert "model.dtype auto -> bfloat16 (checkpoint stored in bfloat16 (config.json dtype)" in validated.output
    monkeypatch.setenv(FLAGS_ENV, AVX2)
    estimated = CliRunner().invoke(main, ["estimate", str(job), "--json"])
    assert estimated.exit_code == 0, estimated.output
    dtype = json.loads(estimated.output)["dtype"]
    assert dtype["setting"] == "auto" and dtype["resolved"] == "float32" and "no amx_bf16" in dtype["why"]


@pytest.mark.parametrize(("flags", "dtype"), [(NATIVE, "bfloat16"), (AVX2, "float32")])
def test_the_hf_backend_follows_the_same_rule(
    flags: str, dtype: str, tmp_path: Path, bf16_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a", "b"], "prompt": ["w5 w6 w7", "w8 w9"]})
    job = write_job(tmp_path / "job.yaml", make_job(bf16_model, str(data), tmp_path / "out"))  # engine.backend hf
    monkeypatch.setenv(FLAGS_ENV, flags)
    assert _run(job)[0] == 0
    assert [r["dtype"] for r in _record(tmp_path / "out")["runtimes"]] == [dtype]
