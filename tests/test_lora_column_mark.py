"""Only batchgen's own adapter column counts per adapter (outputs/adapter_field): a job WITHOUT
adapters whose input has a `lora` column keeps it as the user's data (no per-adapter totals in
`_SUCCESS`, on resume or in `report`), and an output of the release before the mark (its adapter
column unmarked, its job record naming the adapters) still gives per-adapter totals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.outputs.adapter_field import adapter_column, adapter_field, is_marked, unmarked
from batchgen.outputs.table import output_schema
from tests.conftest import output_table, write_job, write_parquet

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "sample_data" / "demo-model"
ADAPTERS = {n: str(REPO / "sample_data" / "lora" / n) for n in ("storyteller", "terse")}
USER_LORA = ["storyteller", None, "rank-8", "storyteller", None, "terse"]  # the user's own data


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _job(tmp: Path, lora: dict[str, str] | None, column: str) -> Path:
    names = USER_LORA
    write_parquet(
        tmp / "in.parquet",
        {"id": [f"r{i}" for i in range(len(names))], "prompt": ["Once upon a time"] * len(names), column: names},
    )
    job: dict[str, Any] = {
        "model": {"path": str(DEMO)},
        "input": {"path": str(tmp / "in.parquet"), "id_column": "id"},
        "output": {"path": str(tmp / "out")},
        "sampling": {"max_tokens": 3},
        "engine": {"backend": "native", "window_rows": 2},
    }
    if lora is not None:
        job["model"]["lora"] = lora
        job["input"]["lora_column"] = column
    return write_job(tmp / "job.yaml", job)


def _success(out: Path) -> dict[str, Any]:
    return json.loads((out / "_SUCCESS").read_text())


def _report(out: Path, *args: str) -> dict[str, Any]:
    code, text = _cli("report", str(out), "--json", *args)
    assert code == 0, text  # (3: the parts disagree with _SUCCESS)
    return json.loads(text)


def test_a_users_lora_column_is_data_not_adapters(tmp_path: Path) -> None:
    job = _job(tmp_path, None, "lora")
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    out = tmp_path / "out"
    table = output_table(out)
    assert table.column("lora").to_pylist() == USER_LORA  # carried as it was
    assert not is_marked(pq.read_schema(out / "part-000000.parquet").field("lora"))
    assert "lora" not in _success(out)  # no per-adapter totals: the job has no adapters
    body = _report(out, "--by", "lora")
    assert "match" in body["status"]
    groups = {g["group"]: g["rows"] for g in body["groups"]}
    assert groups == {"(null)": 2, "rank-8": 1, "storyteller": 2, "terse": 1}  # any column: null is "(null)"
    # finalize and a resume count the committed parts again (the part audit): still no adapters
    (out / "_SUCCESS").unlink()
    code, text = _cli("finalize", str(out))
    assert code == 0, text
    assert "lora" not in _success(out)
    (out / "_SUCCESS").unlink()
    (out / "part-000001.parquet").unlink()
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    assert "lora" not in _success(out) and _success(out)["rows"]["total"] == len(USER_LORA)
    assert "match" in _report(out)["status"]
    success = _success(out)
    success["lora"] = {"storyteller": {"rows": 2, "ok": 2, "input": 1, "cached": 0, "output": 1}}
    (out / "_SUCCESS").write_text(json.dumps(success))  # as the release before the fix counted the column
    assert "match" in _report(out)["status"]  # figures of no adapter: not the parts' to reproduce


def test_an_adapter_output_of_the_release_before_the_mark_keeps_its_totals(tmp_path: Path) -> None:
    job = _job(tmp_path, ADAPTERS, "adapter")
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    out = tmp_path / "out"
    assert is_marked(pq.read_schema(out / "part-000000.parquet").field("lora"))
    expected = _success(out)["lora"]
    assert set(expected) == {"(base)", "storyteller", "terse", "rank-8"}  # rank-8: an unknown adapter's error row
    _make_old(out)
    assert not any(is_marked(pq.read_schema(p).field("lora")) for p in out.glob("part-*.parquet"))
    code, text = _cli("finalize", str(out))  # the part audit, told by the record that the job has adapters
    assert code == 0, text
    assert _success(out)["lora"] == expected
    body = _report(out, "--by", "lora")
    assert "match" in body["status"]
    assert {g["group"]: g["rows"] for g in body["groups"]} == {k: v["rows"] for k, v in expected.items()}
    (out / "_SUCCESS").unlink()
    (out / "part-000000.parquet").unlink()  # a resume: old parts kept, part 0 written anew (marked)
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    assert is_marked(pq.read_schema(out / "part-000000.parquet").field("lora"))
    assert _success(out)["lora"] == expected
    assert "match" in _report(out, "--by", "lora")["status"]


def _make_old(out: Path) -> None:
    """The output as the release before the mark left it: parts without the mark and without their
    description in the job record (an older part is then checked by its rows), no `_SUCCESS`."""
    for path in out.glob("part-*.parquet"):
        table = pq.read_table(path)
        schema = pa.schema([unmarked(f) for f in table.schema], metadata=table.schema.metadata)
        pq.write_table(table.cast(schema), path)
    record = json.loads((out / "_JOB.json").read_text())
    record.pop("part_checks", None)
    (out / "_JOB.json").write_text(json.dumps(record))
    (out / "_SUCCESS").unlink()


def test_adapter_column_is_decided_by_the_mark_or_the_job_record() -> None:
    plain = pa.schema([pa.field("lora", pa.string())])
    marked = pa.schema([pa.field("x", pa.int64()), adapter_field()])
    assert adapter_column(plain) is None  # a user's column merely named `lora`
    assert adapter_column(plain, job_has_adapters=True) == "lora"  # the release before the mark
    assert adapter_column(marked) == "lora"
    kept = pa.field("lora", pa.string(), metadata={b"batchgen": b"lora_adapter", b"other": b"1"})
    assert unmarked(kept).metadata == {b"other": b"1"} and not is_marked(unmarked(adapter_field()))


def test_a_carried_column_loses_the_mark() -> None:
    """An earlier LoRA job's output read as the input of a job without adapters: its `lora` is data."""
    schema = output_schema([pa.field("id", pa.string()), adapter_field()], add_row_id=False)
    assert adapter_column(schema) is None
    assert schema.field("lora").type == pa.string()
