"""Text inputs as real files come: a UTF-8 byte-order mark, files with no rows, and a folder of CSVs
whose numeric columns are typed differently per file (whole numbers in one, decimals in another)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import make_job, write_job

BOM = b"\xef\xbb\xbf"


def _run(tmp: Path, model: Path, inputs: Path, **input_keys: Any) -> tuple[int, str]:
    tmp.mkdir(exist_ok=True)
    job = make_job(model, str(inputs), tmp / "out", sampling={"max_tokens": 3})
    job["input"].update(input_keys)
    result = CliRunner().invoke(main, ["run", str(write_job(tmp / "job.yaml", job)), "--quiet"])
    return result.exit_code, result.output


def _table(out: Path) -> pa.Table:
    return ds.dataset(out, format="parquet").to_table()


def test_a_byte_order_mark_is_skipped_in_csv_and_jsonl(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "in.csv").write_bytes(BOM + b"qid,question\n1,the cat\n2,the sun\n")
    keys = {"prompt_column": "question", "id_column": "qid"}
    code, output = _run(tmp_path / "csv", tiny_model_dir, tmp_path / "in.csv", **keys)
    assert code == 0, output
    assert _table(tmp_path / "csv" / "out").column("qid").to_pylist() == [1, 2]
    (tmp_path / "in.jsonl").write_bytes(BOM + b'{"id": "a", "prompt": "the cat"}\n{"id": "b", "prompt": "the sun"}\n')
    code, output = _run(tmp_path / "jsonl", tiny_model_dir, tmp_path / "in.jsonl")
    assert code == 0, output
    rows = _table(tmp_path / "jsonl" / "out").select(["id", "error_code"]).to_pylist()
    assert rows == [{"id": "a", "error_code": None}, {"id": "b", "error_code": None}]


def test_a_numeric_column_typed_int_in_one_csv_and_double_in_another_is_widened(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.csv").write_text("id,prompt,temp,n\n1,the cat,0,7\n2,the sun,1,8\n")
    (tmp_path / "in" / "b.csv").write_text("id,prompt,temp,n\n3,the dog,0.5,9.5\n")
    keys = {"format": "csv", "sampling_columns": {"temperature": "temp"}}
    code, output = _run(tmp_path, tiny_model_dir, tmp_path / "in", **keys)
    assert code == 0, output
    table = _table(tmp_path / "out")
    assert table.schema.field("temp").type == pa.float64() and table.schema.field("n").type == pa.float64()
    assert table.select(["id", "temp", "n", "error_code"]).to_pylist() == [
        {"id": 1, "temp": 0.0, "n": 7.0, "error_code": None},
        {"id": 2, "temp": 1.0, "n": 8.0, "error_code": None},
        {"id": 3, "temp": 0.5, "n": 9.5, "error_code": None},
    ]


def test_text_inputs_with_no_rows_give_one_empty_part(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n  \n\n")
    (tmp_path / "header.csv").write_text("id,prompt\n")
    for name in ("empty.jsonl", "blank.jsonl", "header.csv"):
        code, output = _run(tmp_path / name.replace(".", "_"), tiny_model_dir, tmp_path / name)
        assert code == 0, (name, output)
        out = tmp_path / name.replace(".", "_") / "out"
        assert sorted(p.name for p in out.glob("part-*")) == ["part-000000.parquet"]
        table = _table(out)
        assert table.num_rows == 0 and {"id", "prompt", "generated_text"} <= set(table.column_names)


def test_an_empty_file_beside_others_neither_lacks_columns_nor_changes_types(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    for kind, rows in (("jsonl", '{"id": 1, "prompt": "the cat", "n": 3}\n'), ("csv", "id,prompt,n\n1,the cat,3\n")):
        folder = tmp_path / kind / "in"
        folder.mkdir(parents=True)
        (folder / f"a.{kind}").write_text("" if kind == "jsonl" else "id,prompt,n\n")
        (folder / f"b.{kind}").write_text(rows)
        code, output = _run(tmp_path / kind, tiny_model_dir, folder, format=kind)
        assert code == 0, (kind, output)
        table = _table(tmp_path / kind / "out")
        assert table.select(["id", "prompt", "n", "error_code"]).to_pylist() == [
            {"id": 1, "prompt": "the cat", "n": 3, "error_code": None}
        ]
        assert table.schema.field("n").type == pa.int64()
