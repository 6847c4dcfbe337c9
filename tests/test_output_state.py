"""The output folder across runs, through the CLI: temp writes never outlive a failure, stray files
are not ours, a run that committed nothing binds the folder to no job, a 0-row input still reads
back with its columns, and `_SUCCESS` names its inputs by normalised paths."""

from __future__ import annotations

import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchgen import faults
from batchgen.cli import main
from batchgen.errors import OutputError
from batchgen.outputs.parts import PartWriter
from batchgen.outputs.state import OutputState
from batchgen.outputs.table import RESULT_NAMES, output_schema
from batchgen.storage import local
from batchgen.storage.base import temp_name
from batchgen.storage.local import LocalStorage
from tests.conftest import make_job, write_job, write_parquet


def _job(tmp_path: Path, model: Path, rows: int = 6, **sections: dict) -> Path:
    data = write_parquet(
        tmp_path / "in.parquet",
        {"id": [f"r{i}" for i in range(rows)], "prompt": [f"once upon a time {i}" for i in range(rows)]},
        schema=pa.schema([("id", pa.string()), ("prompt", pa.string())]),
    )
    job = make_job(model, str(data), tmp_path / "out", engine={"window_rows": 4}, sampling={"max_tokens": 3})
    for name, values in sections.items():
        job[name].update(values)
    return write_job(tmp_path / "job.yaml", job)


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def _claim(state: OutputState, record: dict[str, Any]) -> None:
    state.check_record(record)
    state.claim_record(record, refresh=True)


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError, OSError])
def test_every_temp_write_removes_its_file_on_any_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: type[BaseException]
) -> None:
    def broken_fsync(path: Path) -> None:
        raise failure("stopped between write and rename")

    monkeypatch.setattr(local, "_fsync", broken_fsync)
    writer = PartWriter(tmp_path, output_schema([], add_row_id=True))
    for write in (
        lambda: writer.write_part(0, writer.schema.empty_table()),
        lambda: writer.write_success({"rows": {}}),
        lambda: _claim(OutputState(tmp_path), {"id": "x"}),
    ):
        with pytest.raises((failure, OutputError)):  # an OSError is reported as OutputError
            write()
        assert [p.name for p in tmp_path.iterdir() if p.suffix != ".lock"] == []  # no temp file, nothing committed


def test_stray_part_files_are_not_ours(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-old.parquet").write_bytes(b"someone else's file")
    (out / "part-1.parquet").write_bytes(b"not six digits")
    code, text, err = _cli("run", str(job), "--quiet")
    assert code == 0, err
    code, text, err = _cli("report", str(out), "--json")
    assert code == 0, err
    assert json.loads(text)["totals"]["rows"] == 6 and json.loads(text)["parts"] == 2
    code, text, err = _cli("run", str(job), "--quiet", "--overwrite", "--set", "sampling.max_tokens=2")
    assert code == 0, err
    assert (out / "part-old.parquet").read_bytes() == b"someone else's file"
    assert (out / "part-1.parquet").exists()


USERS_HIDDEN = [".notes.tmp", ".part-000001.parquet.notes.tmp", "._SUCCESS.tmp", ".batchgen.tmp"]


def test_a_users_own_hidden_tmp_files_are_never_deleted(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Only batchgen's own temp names are leftovers; a user's hidden *.tmp file is not ours."""
    job = _job(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    out.mkdir()
    for name in USERS_HIDDEN:
        (out / name).write_text("mine")
    ours = out / temp_name("part-000001.parquet")  # a killed run's half-written part
    older = out / f".part-000000.parquet.{'0' * 32}.tmp"  # the same, from a batchgen before the prefix
    ours.write_bytes(b"half a part")
    older.write_bytes(b"half a part")
    code, _, err = _cli("run", str(job), "--quiet")
    assert code == 0, err
    assert not ours.exists() and not older.exists()
    assert {n: (out / n).read_text() for n in USERS_HIDDEN} == dict.fromkeys(USERS_HIDDEN, "mine")
    code, _, err = _cli("run", str(job), "--quiet", "--overwrite", "--set", "sampling.max_tokens=2")
    assert code == 0, err
    assert {n: (out / n).read_text() for n in USERS_HIDDEN} == dict.fromkeys(USERS_HIDDEN, "mine")


def _snapshot(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in out.iterdir() if not p.name.endswith(".lock")}


def _weightless_copy(model: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "weightless-model"
    shutil.copytree(model, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    return copy


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_overwrite_keeps_the_old_output_until_the_new_job_can_run(
    tmp_path: Path, tiny_model_dir: Path, backend: str
) -> None:
    """--overwrite with a model whose weights are missing: exit 4, and the finished output (parts,
    _SUCCESS, _JOB.json) is still there, byte for byte; rerunning the old job finds it finished."""
    job = _job(tmp_path, tiny_model_dir, engine={"backend": backend})
    out = tmp_path / "out"
    assert _cli("run", str(job), "--quiet")[0] == 0
    before = _snapshot(out)
    assert {"_SUCCESS", "_JOB.json", "part-000000.parquet", "part-000001.parquet"} <= set(before)
    broken = _weightless_copy(tiny_model_dir, tmp_path)
    code, _, err = _cli("run", str(job), "--quiet", "--overwrite", "--set", f"model.path={broken}")
    assert code == 4, err
    assert _snapshot(out) == before
    code, text, err = _cli("run", str(job), "--quiet")
    assert code == 0 and "already finished" in text, err


def test_overwrite_keeps_the_old_output_when_the_engine_fails_before_the_first_commit(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _job(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    assert _cli("run", str(job), "--quiet")[0] == 0
    before = _snapshot(out)
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("BATCHGEN_FAULT", "engine_exception")  # the first part's engine run fails
    code, _, err = _cli("run", str(job), "--quiet", "--overwrite", "--set", "sampling.max_tokens=2")
    assert code == 6, err
    assert _snapshot(out) == before
    monkeypatch.delenv("BATCHGEN_FAULT")
    code, _, err = _cli("run", str(job), "--quiet", "--overwrite", "--set", "sampling.max_tokens=2")
    assert code == 0, err
    after = _snapshot(out)
    assert after["_JOB.json"] != before["_JOB.json"] and after["_SUCCESS"] != before["_SUCCESS"]
    assert all(n <= 2 for n in ds.dataset(out).to_table().column("output_tokens").to_pylist())


def test_overwrite_replaces_more_parts_than_the_new_job_has(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The old job's parts beyond the new job's last one go too: the output is the new job's alone."""
    job = _job(tmp_path, tiny_model_dir, rows=10)  # 3 parts of 4 rows
    out = tmp_path / "out"
    assert _cli("run", str(job), "--quiet")[0] == 0
    assert len(LocalStorage(out).committed_parts()) == 3
    code, _, err = _cli("run", str(job), "--quiet", "--overwrite", "--set", "engine.window_rows=8")
    assert code == 0, err
    assert list(LocalStorage(out).committed_parts()) == [0, 1]
    assert ds.dataset(out).to_table().num_rows == 10
    code, text, err = _cli("report", str(out))
    assert code == 0 and "finished" in text, err


def test_a_run_that_committed_nothing_does_not_block_the_corrected_rerun(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:1000])  # loading the weights fails, after the output was claimed
    job = _job(tmp_path, model)
    out = tmp_path / "out"
    code, _, err = _cli("run", str(job), "--quiet")
    assert code == 4 and "weights cannot be loaded" in err, err
    assert (out / "_JOB.json").exists() and not list(out.glob("part-*"))
    weights.write_bytes(intact)  # corrected
    code, text, err = _cli("report", str(out))
    assert code == 0, err
    assert "in progress: 0 parts committed" in text
    code, text, err = _cli("run", str(job), "--quiet")  # no --overwrite needed
    assert code == 0, err
    assert ds.dataset(out).to_table().num_rows == 6
    code, _, err = _cli("run", str(job), "--quiet", "--set", "sampling.max_tokens=2")
    assert code == 2 and "made by a different job" in err  # parts committed: now it is this job's


def test_a_zero_row_input_reads_back_with_its_columns(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir, rows=0)
    out = tmp_path / "out"
    code, text, err = _cli("run", str(job), "--quiet")
    assert code == 0, err
    assert "0 rows ok, 0 failed" in text
    table = ds.dataset(out).to_table()
    assert table.num_rows == 0 and table.column_names == ["id", "prompt", "input_row", *RESULT_NAMES]
    assert table.schema.field("output_tokens").type == pa.int64()
    code, text, err = _cli("report", str(out), "--json")
    assert code == 0, err
    body = json.loads(text)
    assert body["finished"] and body["mismatches"] == [] and body["totals"]["rows"] == 0
    code, text, err = _cli("run", str(job), "--quiet")
    assert code == 0 and "already finished" in text


def test_success_names_inputs_by_normalised_absolute_paths(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir)
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    spec = yaml.safe_load(job.read_text())
    spec["input"]["path"] = "../in.parquet"
    spec["output"]["path"] = "../out"
    moved = write_job(jobs / "job.yaml", spec)
    code, _, err = _cli("run", str(Path(os.path.relpath(moved))), "--quiet")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert manifest["inputs"] == [str(tmp_path / "in.parquet")]  # not ".../jobs/../in.parquet"


def test_nothing_but_part_files_is_read_as_parts(tmp_path: Path) -> None:
    for name in ("part-000000.parquet", "part-000001.parquet", "part-old.parquet", "part-12.parquet"):
        pq.write_table(pa.table({"x": [1]}), tmp_path / name)
    (tmp_path / "part-000002.parquet").mkdir()
    assert list(LocalStorage(tmp_path).committed_parts().values()) == ["part-000000.parquet", "part-000001.parquet"]


def test_report_on_a_run_still_validating_is_in_progress(tmp_path: Path) -> None:
    (tmp_path / ".batchgen.lock").write_text("pid 1 on host since now")  # locked, nothing written yet
    code, text, err = _cli("report", str(tmp_path), "--by", "category")
    assert code == 0, err
    assert "in progress: 0 parts committed, no _SUCCESS" in text


def test_concurrent_record_swaps_on_a_folder_let_exactly_one_land(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    assert store.swap_text("_JOB.json", "old", None, "record_temp_write")
    start = threading.Barrier(8)

    def swap(i: int) -> bool:
        start.wait()
        return store.swap_text("_JOB.json", f"run {i}", "old", "record_temp_write")

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(swap, range(8)))
    assert won.count(True) == 1
    assert store.read_text("_JOB.json") == f"run {won.index(True)}"
