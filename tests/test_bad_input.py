"""Bad input, bad job files, output faults and engine faults: each fails clearly before any work
(naming the file, column or key) or becomes an error row; nothing is lost or half-written."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen import faults
from batchgen.cli import main
from tests.conftest import make_job, output_table, write_job, write_parquet


def _run(job: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", str(job), "--quiet", *args])
    return result.exit_code, result.output


def _good(folder: Path, name: str = "good.parquet", rows: int = 3) -> Path:
    return write_parquet(folder / name, {"id": [f"{name}-{i}" for i in range(rows)], "prompt": ["the cat"] * rows})


@pytest.mark.parametrize("kind", ["zero-byte", "truncated", "garbage"])
def test_unreadable_file_among_good_ones_fails_before_work(tmp_path: Path, tiny_model_dir: Path, kind: str) -> None:
    data = tmp_path / "data"
    good = _good(data)
    bad = data / "bad.parquet"
    content = {"zero-byte": b"", "truncated": good.read_bytes()[:-40], "garbage": b"PAR1 not parquet at all"}
    bad.write_bytes(content[kind])
    out = tmp_path / "out"
    code, text = _run(write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(data), out)))
    assert code == 3
    assert f"{bad}: not a readable Parquet file" in text
    assert not out.exists()


def test_column_types_that_differ_between_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    _good(tmp_path / "data", "a.parquet")
    write_parquet(tmp_path / "data" / "b.parquet", {"id": [1, 2], "prompt": ["x", "y"]})
    code, text = _run(
        write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(tmp_path / "data"), tmp_path / "o"))
    )
    assert code == 3 and "b.parquet: column 'id' is int64" in text and "a.parquet has string" in text


def test_duplicate_ids_and_bad_per_row_settings_become_error_rows(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_parquet(tmp_path / "a.parquet", {"id": ["x", "y", "x"], "prompt": ["the cat"] * 3, "temp": [0.0, -0.5, None]})
    write_parquet(tmp_path / "b.parquet", {"id": ["y", "z", "w"], "prompt": ["a dog"] * 3, "temp": [None, None, 0.5]})
    out = tmp_path / "out"
    job = make_job(
        tiny_model_dir, str(tmp_path / "*.parquet"), out, input={"sampling_columns": {"temperature": "temp"}}
    )
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 0, text
    rows = output_table(out).to_pylist()
    assert [r["id"] for r in rows] == ["x", "y", "x", "y", "z", "w"]  # every row, exactly once
    assert [r["error_code"] for r in rows] == [None, "invalid_sampling", "duplicate_id", "duplicate_id", None, None]
    assert f"first used by {tmp_path / 'a.parquet'} row 0" in rows[2]["error_message"]
    assert "temperature" in rows[1]["error_message"]


def test_bad_job_files_are_refused_before_the_model_loads(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = _good(tmp_path)
    no_tokenizer = tmp_path / "weights-only"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    cases = [
        (make_job(tmp_path / "nope", str(data), tmp_path / "o"), 4, "no such folder"),
        (make_job(no_tokenizer, str(data), tmp_path / "o"), 4, "cannot load a tokenizer"),
        (make_job(tiny_model_dir, str(tmp_path / "missing.parquet"), tmp_path / "o"), 3, "no Parquet files found"),
        (
            make_job(tiny_model_dir, str(data), tmp_path / "o", engine={"wndow_rows": 3}),
            2,
            "engine.wndow_rows: unknown key",
        ),
        (
            make_job(tiny_model_dir, str(data), tmp_path / "o", sampling={"max_tokens": "many"}),
            2,
            "sampling.max_tokens",
        ),
    ]
    for i, (job, code, message) in enumerate(cases):
        got, text = _run(write_job(tmp_path / f"job{i}.yaml", job))
        assert (got, message in text) == (code, True), text
    assert not (tmp_path / "o").exists()


def test_unwritable_output_fails_before_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    job = make_job(tiny_model_dir, str(_good(tmp_path)), blocker / "out")
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 5 and f"output.path {blocker / 'out'}: not writable" in text


def test_disk_full_mid_write_keeps_earlier_parts(tmp_path: Path, tiny_model_dir: Path, monkeypatch) -> None:
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "job.yaml", make_job(tiny_model_dir, str(_good(tmp_path, rows=8)), out, engine={"window_rows": 4})
    )
    real_write = pq.write_table
    calls = []

    def write_then_fail(table: pa.Table, where: object, **kw: object) -> None:
        calls.append(where)
        if len(calls) == 2:
            Path(str(where)).write_bytes(b"half a part")
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(table, where, **kw)

    monkeypatch.setattr(pq, "write_table", write_then_fail)
    code, text = _run(job)
    assert code == 5 and "No space left on device" in text and "part-000001.parquet" in text
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".batchgen")) == [
        "_JOB.json",
        "part-000000.parquet",
    ]
    assert pq.read_table(out / "part-000000.parquet").num_rows == 4
    monkeypatch.setattr(pq, "write_table", real_write)
    assert _run(job)[0] == 0  # the rerun completes
    assert ds.dataset(out, format="parquet").to_table().num_rows == 8


def test_engine_exception_abandons_the_part_and_a_rerun_completes(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch
) -> None:
    out = tmp_path / "out"
    job = write_job(
        tmp_path / "job.yaml", make_job(tiny_model_dir, str(_good(tmp_path, rows=8)), out, engine={"window_rows": 4})
    )
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("BATCHGEN_FAULT", "engine_exception:6")  # inside the second part
    code, text = _run(job)
    assert code == 6 and "engine failed on rows 4-7" in text and "simulated engine failure" in text
    assert sorted(p.name for p in out.glob("part-*")) == ["part-000000.parquet"]
    monkeypatch.delenv("BATCHGEN_FAULT")
    assert _run(job)[0] == 0
    manifest = json.loads((out / "_SUCCESS").read_text())
    assert manifest["rows"]["total"] == 8


def test_an_engine_refusal_names_the_file_row_and_id(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A row the engine refuses (per-row max_tokens beyond a tiny KV pool: 2 blocks of 16 tokens)
    is an engine_error row whose message names the file, row and id, as every error row's does,
    not the engine's own request number."""
    data = write_parquet(
        tmp_path / "in.parquet",
        {"id": ["a", "b", "c", "d"], "prompt": ["the cat"] * 4, "budget": [3, 40, 2, 60]},
    )
    out = tmp_path / "out"
    job = make_job(
        tiny_model_dir,
        str(data),
        out,
        input={"sampling_columns": {"max_tokens": "budget"}},
        engine={"backend": "native", "num_kv_blocks": 2, "block_size": 16, "enable_prefix_caching": False},
    )
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 0, text
    rows = {r["id"]: r for r in output_table(out).to_pylist()}
    assert [rows[i]["error_code"] for i in "abcd"] == [None, "engine_error", None, "engine_error"]
    for row_index, row_id in ((1, "b"), (3, "d")):
        message = rows[row_id]["error_message"]
        assert message.startswith(f"{data} row {row_index} (id {row_id}): prompt + max_tokens = "), message
        assert "needs 3 KV blocks" in message or "needs 4 KV blocks" in message
        assert "request " not in message
