"""A resume trusts only the parts this job committed (part_record), and only on the runtime that
made them (runtime_record): a truncated or replaced part is redone, an older batchgen's part is
checked by its rows, and a device or dtype that resolves differently is refused unless allowed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen import faults
from batchgen.backends.native import NativeBackend
from batchgen.cli import main
from batchgen.errors import FingerprintMismatch
from batchgen.outputs.runtime_record import claim_runtime
from batchgen.storage.local import LocalStorage
from tests.conftest import make_job, write_job, write_parquet

ROWS = 16  # window 4: 4 parts
WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
# cached_tokens is left out: a redone part shares its process's prefix cache with other parts than
# in a clean run (README, "cached_tokens under shards and resume"); every other column must match.
COLUMNS = ["id", "generated_text", "finish_reason", "input_tokens", "output_tokens"]
CPU = {"device": "cpu", "dtype": "float32", "attention_backend": "cpu"}  # what `auto` resolves to here
GPU = {"device": "cuda", "dtype": "bfloat16", "attention_backend": "torch"}  # and on a GPU


def _job(tmp_path: Path, model: Path) -> tuple[Path, Path]:
    prompts = [" ".join(WORDS[(i + j) % 10] for j in range(3 + i % 5)) for i in range(ROWS)]
    data = write_parquet(tmp_path / "in.parquet", {"id": [f"r{i}" for i in range(ROWS)], "prompt": prompts})
    out = tmp_path / "out"
    engine = {"backend": "native", "window_rows": 4}  # grouping none: parts of 4 rows each (one replaces another)
    job = make_job(model, str(data), out, engine=engine, input={"grouping": "none"}, sampling={"max_tokens": 5})
    return write_job(tmp_path / "job.yaml", job), out


def _run(job: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", *args])
    return result.exit_code, result.output


def _rows(out: Path) -> list[tuple[Any, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=COLUMNS)
    return sorted(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


def _record(out: Path) -> dict[str, Any]:
    return json.loads((out / "_JOB.json").read_text())


@pytest.fixture
def finished(tmp_path: Path, tiny_model_dir: Path) -> tuple[Path, Path, list[tuple[Any, ...]]]:
    """A finished job, its rows (the clean run), and `_SUCCESS` removed: as if killed just before it."""
    job, out = _job(tmp_path, tiny_model_dir)
    assert _run(job)[0] == 0
    (out / "_SUCCESS").unlink()
    return job, out, _rows(out)


def test_a_truncated_and_a_replaced_part_are_redone_not_trusted(finished: tuple[Path, Path, list]) -> None:
    job, out, clean = finished
    part1, part2 = out / "part-000001.parquet", out / "part-000002.parquet"
    part1.write_bytes(part1.read_bytes()[:-100])  # truncated (a bad copy, a disk that lied)
    part2.write_bytes((out / "part-000000.parquet").read_bytes())  # replaced: valid Parquet, other rows, same count
    code, text = _run(job)
    assert code == 0, text
    assert "resumed: 2 part(s) kept | redone: part-000001.parquet, part-000002.parquet" in text
    assert _rows(out) == clean  # every row once, as the clean run
    again = CliRunner().invoke(main, ["report", str(out), "--json"])
    assert again.exit_code == 0, again.output  # _SUCCESS agrees with the parts


def test_the_log_names_the_part_and_why(finished: tuple[Path, Path, list], caplog: pytest.LogCaptureFixture) -> None:
    job, out, _ = finished
    part = out / "part-000003.parquet"
    part.write_bytes(part.read_bytes()[:-1])
    caplog.set_level("WARNING", logger="batchgen")
    assert _run(job)[0] == 0
    assert any(str(part) in r.message and "truncated or replaced" in r.message for r in caplog.records)


def test_parts_of_an_older_batchgen_are_checked_by_their_rows(finished: tuple[Path, Path, list]) -> None:
    job, out, clean = finished
    record = _record(out)
    del record["part_checks"]  # as an older batchgen wrote it
    (out / "_JOB.json").write_text(json.dumps(record))
    short = pq.read_table(out / "part-000001.parquet").slice(0, 3)
    pq.write_table(short, out / "part-000001.parquet")  # a readable part with a row missing
    code, text = _run(job)
    assert code == 0 and "resumed: 3 part(s) kept | redone: part-000001.parquet" in text, text
    assert _rows(out) == clean
    assert sorted(_record(out)["part_checks"]) == [f"part-00000{i}.parquet" for i in range(4)]  # described now


def test_a_finalize_does_not_count_a_damaged_part(finished: tuple[Path, Path, list]) -> None:
    _, out, _ = finished
    part = out / "part-000002.parquet"
    part.write_bytes(part.read_bytes()[:-10])
    refused = CliRunner().invoke(main, ["finalize", str(out)])
    assert refused.exit_code == 8 and "part-000002.parquet" in refused.output, refused.output
    assert not (out / "_SUCCESS").exists()


def _started_on_cpu(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """Half a job: the engine fails in its third part (exit 6), two parts committed on the CPU."""
    job, out = _job(tmp_path, model)
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("BATCHGEN_FAULT", "engine_exception:9")
    assert _run(job)[0] == 6
    monkeypatch.delenv("BATCHGEN_FAULT")
    assert _record(out)["runtimes"] == [CPU]
    return job, out


def test_resuming_on_another_device_or_dtype_is_refused_unless_allowed(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, out = _started_on_cpu(tmp_path, tiny_model_dir, monkeypatch)
    kept = sorted(p.name for p in out.glob("part-*"))
    # as if `device: auto` and `dtype: auto` now resolved on a GPU
    monkeypatch.setattr(NativeBackend, "resolved", lambda self: GPU)
    code, text = _run(job)
    assert code == 2, text
    assert "generated on cpu, float32, attention_backend cpu, and this run resolves to cuda, bfloat16" in text
    assert "--allow-precision-change" in text
    assert sorted(p.name for p in out.glob("part-*")) == kept  # nothing generated, nothing committed
    code, text = _run(job, "--allow-precision-change")
    both = "cpu, float32, attention_backend cpu; cuda, bfloat16, attention_backend torch"
    assert code == 0 and f"mixed runtimes (allowed): {both}" in text, text
    manifest = json.loads((out / "_SUCCESS").read_text())
    assert manifest["runtimes"] == [CPU, GPU]
    assert manifest["precision_changed"] is True
    assert {c["runtime"] for checks in _record(out)["part_checks"].values() for c in checks} == {0, 1}
    report = CliRunner().invoke(main, ["report", str(out)])
    assert report.exit_code == 0 and f"parts from several runtimes: {both}" in report.output


def test_resuming_on_the_same_runtime_says_nothing_of_runtimes(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, out = _started_on_cpu(tmp_path, tiny_model_dir, monkeypatch)
    code, text = _run(job)
    assert code == 0 and "mixed runtimes" not in text, text
    manifest = json.loads((out / "_SUCCESS").read_text())
    assert manifest["runtimes"] == [CPU] and "precision_changed" not in manifest


def test_another_attention_backend_is_refused_too(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """engine.attention_backend is a tuning key (outside the fingerprint), but its kernels round
    differently: a resume with another one is refused as another precision is, with no stand-in."""
    job, _ = _started_on_cpu(tmp_path, tiny_model_dir, monkeypatch)
    code, text = _run(job, "--set", "engine.attention_backend=torch")
    assert code == 2 and "and this run resolves to cpu, float32, attention_backend torch" in text, text
    code, text = _run(job, "--set", "engine.attention_backend=torch", "--allow-precision-change")
    both = "cpu, float32, attention_backend cpu; cpu, float32, attention_backend torch"
    assert code == 0 and f"mixed runtimes (allowed): {both}" in text, text


def test_a_runtime_key_added_later_is_no_difference(tmp_path: Path) -> None:
    """A later batchgen that also records the attention backend resumes an output made before it."""
    (tmp_path / "_JOB.json").write_text(json.dumps({"id": "x", "runtimes": [{"device": "cpu", "dtype": "float32"}]}))
    store = LocalStorage(tmp_path)
    newer = {"device": "cpu", "dtype": "float32", "attention_backend": "torch"}
    assert claim_runtime(store, newer, allow_change=False) == 0
    assert _record(tmp_path)["runtimes"] == [newer]
    with pytest.raises(FingerprintMismatch, match=r"attention_backend torch.*attention_backend cpu"):
        claim_runtime(store, {**newer, "attention_backend": "cpu"}, allow_change=False)
    assert claim_runtime(store, {**newer, "attention_backend": "cpu"}, allow_change=True) == 1
