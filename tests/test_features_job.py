"""Penalties and structured output through the job file and the CLI: per-row columns, error rows,
refusals before any work, the hf backend's mapping onto generate, and a missing xgrammar."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pyarrow.dataset as ds
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import make_job, write_job, write_parquet

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "big"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
PROMPTS = ["once upon a time", "the cat liked", "a little dog", "her friend"]


def _run(job: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", *args])
    return result.exit_code, result.output


def _rows(out: Path) -> list[dict[str, Any]]:
    return sorted(ds.dataset(out).to_table().to_pylist(), key=lambda r: r["id"])


def test_per_row_schema_column_validates_and_a_bad_schema_is_an_error_row(tmp_path: Path, tiny_model_dir: Path) -> None:
    schemas = [json.dumps(SCHEMA), '{"type": "nonsense"}', None, json.dumps({"type": "array", "maxItems": 0})]
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a", "b", "c", "d"], "prompt": PROMPTS, "schema": schemas})
    out = tmp_path / "out"
    job = make_job(
        tiny_model_dir,
        str(data),
        out,
        input={"sampling_columns": {"json_schema": "schema"}},
        sampling={"max_tokens": 40, "temperature": 1.0, "seed": 5},
        engine={"backend": "native"},
    )
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 0, text
    a, b, c, d = _rows(out)
    jsonschema.validate(json.loads(a["generated_text"]), SCHEMA)
    assert a["finish_reason"] == "stop"
    assert b["error_code"] == "invalid_structured"
    assert "row 1 (id b)" in b["error_message"] and "Unsupported type" in b["error_message"]
    assert c["error_code"] is None  # a null cell keeps the job default (no constraint)
    assert d["generated_text"] == "[]" and d["finish_reason"] == "stop"


def test_a_job_level_schema_that_cannot_compile_fails_before_any_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a"], "prompt": ["the cat"]})
    out = tmp_path / "out"
    bad = {"structured": {"regex": "(unclosed"}}
    job = write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(data), out, sampling=bad))
    code, text = _run(job)
    assert code == 2
    assert "sampling.structured: regex does not compile" in text and "not closed" in text
    assert not out.exists()


def test_hf_backend_refuses_what_generate_lacks_before_any_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a"], "prompt": ["the cat"], "pp": [0.5]})
    out = tmp_path / "out"
    job = make_job(
        tiny_model_dir,
        str(data),
        out,
        sampling={"allowed_token_ids": [1, 2]},
        input={"sampling_columns": {"presence_penalty": "pp"}},
    )
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 2
    assert "sampling.allowed_token_ids: engine.backend hf does not support this setting" in text
    assert "input.sampling_columns.presence_penalty: engine.backend hf does not support" in text
    assert not out.exists()


def test_native_and_hf_agree_on_penalties_bias_and_bad_words(tmp_path: Path, tiny_model_dir: Path) -> None:
    """hf runs transformers' own processors; the native engine must produce the same greedy tokens."""
    data = write_parquet(
        tmp_path / "in.parquet", {"id": ["a", "b", "c", "d"], "prompt": PROMPTS, "rp": [1.6, None, 0.8, 2.0]}
    )
    sampling = {"max_tokens": 16, "repetition_penalty": 1.2, "logit_bias": {40: 3.0}, "bad_words": ["the", "cat"]}
    texts = {}
    for backend in ("native", "hf"):
        out = tmp_path / backend
        job = make_job(
            tiny_model_dir,
            str(data),
            out,
            input={"sampling_columns": {"repetition_penalty": "rp"}},
            sampling=sampling,
            engine={"backend": backend, "batch_size": 1},
        )
        code, text = _run(write_job(tmp_path / f"{backend}.yaml", job))
        assert code == 0, text
        texts[backend] = [r["generated_text"] for r in _rows(out)]
    assert texts["native"] == texts["hf"]
    assert not any(" the" in t or " cat" in t for t in texts["native"])


def test_a_non_string_schema_column_fails_before_any_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a"], "prompt": ["x"], "schema": pa.array([1], pa.int64())})
    out = tmp_path / "out"
    columns = {"sampling_columns": {"json_schema": "schema"}}
    job = make_job(tiny_model_dir, str(data), out, input=columns, engine={"backend": "native"})
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 3 and "column 'schema' (input.sampling_columns.json_schema) holds int64" in text
    assert not out.exists()


def test_missing_xgrammar_says_how_to_install_it(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A real failing import in a child process: an `xgrammar` package that raises ImportError shadows the real one."""
    shadow = tmp_path / "shadow" / "xgrammar"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named xgrammar (simulated)')\n")
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a"], "prompt": ["x"]})
    sampling = {"structured": {"choice": ["yes", "no"]}}
    job = write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(data), tmp_path / "out", sampling=sampling))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", "validate", str(job)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'batchgen[structured]'" in done.stderr + done.stdout
    assert "sampling.structured" in done.stderr + done.stdout
    # a per-row schema column needs it as much: the job fails at load, not row by row
    write_parquet(tmp_path / "in.parquet", {"id": ["a"], "prompt": ["x"], "schema": ['{"type": "object"}']})
    columns = {"sampling_columns": {"json_schema": "schema"}}
    native = {"backend": "native"}
    job = write_job(
        tmp_path / "job.yaml", make_job(tiny_model_dir, str(data), tmp_path / "out", input=columns, engine=native)
    )
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", "validate", str(job)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert "input.sampling_columns.json_schema" in done.stderr + done.stdout
    assert "pip install 'batchgen[structured]'" in done.stderr + done.stdout


def test_the_new_settings_at_their_defaults_leave_an_older_fingerprint_unchanged(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from batchgen.job.spec import load_job
    from batchgen.outputs.fingerprint import job_fingerprint

    data = write_parquet(tmp_path / "in.parquet", {"id": ["a"], "prompt": ["x"]})
    job = write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(data), tmp_path / "out"))
    plain = job_fingerprint(load_job(job), [])
    # the sampling keys an output written before these features existed was fingerprinted with
    older = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids"}
    older |= {"include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens"}
    assert set(plain["settings"]["sampling"]) <= older  # n, logprobs, penalties, ... absent at their defaults
    penalized = job_fingerprint(load_job(job, ["sampling.repetition_penalty=1.2"]), [])
    assert penalized["id"] != plain["id"]
    assert penalized["settings"]["sampling"]["repetition_penalty"] == 1.2


def test_the_quickstart_structured_job_is_valid() -> None:
    """jobs/structured.yaml (run by hand on the demo model: 500 of 500 outputs validate) loads and compiles."""
    result = CliRunner().invoke(main, ["validate", str(Path(__file__).parent.parent / "jobs/structured.yaml")])
    assert result.exit_code == 0, result.output
