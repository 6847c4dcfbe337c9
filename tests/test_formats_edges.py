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
