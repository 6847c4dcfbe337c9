"""Input formats end to end: JSONL, CSV and a `datasets` folder (made by the real `datasets`
package) give the same output as the same rows in Parquet, chosen by extension, state files or
input.format; bad lines and malformed records become error rows naming file and line; late parts
read from seek points; resume, shards and an object store work as for Parquet."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.inputs import text_lines
from batchgen.inputs.dataset import plan_shards
from batchgen.inputs.reading import open_inputs, read_shards
from tests.conftest import make_job, write_job, write_parquet
from tests.s3_server import moto_s3, options

PROMPTS = ["once upon a time", "the little cat", "a dog who liked to play in the sun", "her friend", "the sun"]
IDS = [f"r{i}" for i in range(11)]
RESULTS = ["id", "generated_text", "finish_reason", "input_tokens", "output_tokens", "error_code"]


def _rows() -> dict[str, list[Any]]:
    return {"id": IDS, "prompt": [PROMPTS[i % 5] + " " + PROMPTS[(i * 3) % 5] for i in range(11)]}


def _run(tmp: Path, model: Path, inputs: str, out: Path, *args: str, **input_keys: Any) -> str:
    job = make_job(model, inputs, out, engine={"window_rows": 3}, sampling={"max_tokens": 5})
    job["input"].update(input_keys)
    result = CliRunner().invoke(main, ["run", str(write_job(tmp / "job.yaml", job)), "--quiet", *args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def _read(out: Path, columns: list[str] = RESULTS) -> list[dict[str, Any]]:
    return ds.dataset(out, format="parquet").to_table(columns=columns).to_pylist()


def _write_jsonl(path: Path, rows: dict[str, list[Any]]) -> Path:
    lines = [json.dumps(dict(zip(rows, values))) for values in zip(*rows.values())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _write_csv(path: Path, rows: dict[str, list[Any]]) -> Path:
    import csv

    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(list(rows))
        writer.writerows(zip(*rows.values()))
    return path


def _write_dataset(path: Path, rows: dict[str, list[Any]]) -> Path:
    import datasets

    datasets.Dataset.from_dict(rows).save_to_disk(str(path), num_shards=2)  # two Arrow files, in order
    return path


@pytest.fixture(scope="module")
def parquet_result(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("parquet")
    _run(tmp, tiny_model_dir, str(write_parquet(tmp / "in.parquet", _rows())), tmp / "out")
    return _read(tmp / "out")


@pytest.mark.parametrize(
    ("name", "write", "declared"),
    [
        ("in.jsonl", _write_jsonl, None),
        ("in.csv", _write_csv, None),
        ("ds", _write_dataset, None),  # auto: found by its state.json
        ("rows.txt", _write_jsonl, "jsonl"),  # no known extension: input.format says
    ],
)
def test_each_format_gives_the_parquet_output(
    tmp_path: Path,
    tiny_model_dir: Path,
    parquet_result: list[dict[str, Any]],
    name: str,
    write: Any,
    declared: str | None,
) -> None:
    path = write(tmp_path / name, _rows())
    keys = {"format": declared} if declared else {}
    _run(tmp_path, tiny_model_dir, str(path), tmp_path / "out", **keys)
    assert _read(tmp_path / "out") == parquet_result
    carried = ds.dataset(tmp_path / "out", format="parquet").to_table(columns=["prompt"]).column("prompt")
    assert carried.to_pylist() == _rows()["prompt"]
    manifest = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert manifest["rows"] == {"total": 11, "ok": 11, "error": 0} and manifest["parts"] == 4


def test_bad_jsonl_lines_become_error_rows_naming_file_and_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    good = [json.dumps({"id": "a", "prompt": "once upon a time"}), json.dumps({"id": "b", "prompt": "the cat"})]
    raw = "\n".join([good[0], "{not json", "", "[1, 2]", good[1]]).encode() + b"\n" + b'{"id": "c", "prompt": "\xff"}\n'
    (tmp_path / "in.jsonl").write_bytes(raw)
    _run(tmp_path, tiny_model_dir, str(tmp_path / "in.jsonl"), tmp_path / "out")
    rows = _read(tmp_path / "out", ["id", "error_code", "error_message", "output_tokens"])
    assert [r["error_code"] for r in rows] == [None, "invalid_json", "invalid_json", None, "invalid_utf8"]
    assert [r["id"] for r in rows] == ["a", None, None, "b", None]
    where = str(tmp_path / "in.jsonl")
    assert rows[1]["error_message"].startswith(f"{where} row 1 (line 2) (id None): not valid JSON")
    assert (
        "row 2 (line 4) (id None): a row must be a JSON object, got list" in rows[2]["error_message"]
    )  # line 3 is blank: no row
    assert "row 4 (line 6) (id None): not valid UTF-8" in rows[4]["error_message"]
    assert rows[0]["output_tokens"] > 0 and rows[3]["output_tokens"] > 0


def test_malformed_csv_records_become_error_rows(tmp_path: Path, tiny_model_dir: Path) -> None:
    text = 'id,prompt,temperature\n1,"the cat, and the dog",0.5\n2,"two\nlines",\n3,a,b,c\n4,"bad"x,1\n007,the sun,1\n'
    (tmp_path / "in.csv").write_text(text, encoding="utf-8")
    _run(
        tmp_path,
        tiny_model_dir,
        str(tmp_path / "in.csv"),
        tmp_path / "out",
        sampling_columns={"temperature": "temperature"},
    )
    rows = _read(tmp_path / "out", ["id", "prompt", "temperature", "error_code", "error_message"])
    assert [r["error_code"] for r in rows] == [None, None, "invalid_csv", "invalid_csv", None]
    # id stays text (007 is not the number 7); an empty field is null; a quoted field spans lines
    assert [r["id"] for r in rows] == ["1", "2", None, None, "007"]
    assert rows[1]["prompt"] == "two\nlines" and rows[1]["temperature"] is None and rows[0]["temperature"] == 0.5
    assert (
        "row 2 (line 5) (id None): 4 fields, the header has 3" in rows[2]["error_message"]
    )  # line 3-4 is the two-line record
    assert "row 3 (line 6) (id None): malformed CSV record" in rows[3]["error_message"]


def test_a_dataset_dict_folder_is_refused_naming_its_splits(tmp_path: Path, tiny_model_dir: Path) -> None:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict(_rows())}).save_to_disk(str(tmp_path / "dd"))
    job = make_job(tiny_model_dir, str(tmp_path / "dd"), tmp_path / "out")
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
    assert result.exit_code != 0 and "a DatasetDict folder (splits: train)" in result.output
    assert not (tmp_path / "out").exists()
    _run(tmp_path, tiny_model_dir, str(tmp_path / "dd" / "train"), tmp_path / "out")  # one split: served
    assert [r["id"] for r in _read(tmp_path / "out")] == IDS


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_late_parts_read_from_seek_points_equal_a_read_from_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    rows = {"id": list(range(50)), "prompt": [f"p{i}\nsecond line" if i % 7 == 0 else f"p{i}" for i in range(50)]}
    path = (_write_jsonl if fmt == "jsonl" else _write_csv)(tmp_path / f"in.{fmt}", rows)
    monkeypatch.setattr(text_lines, "INDEX_STRIDE", 8)
    from batchgen.inputs import text_formats

    monkeypatch.setattr(text_formats, "INDEX_STRIDE", 8)
    files = open_inputs(str(path), ["id", "prompt"])
    assert files[0].num_rows == 50 and len(files[0].index.points) == 7  # rows 0, 8, ..., 48
    shards = plan_shards(files, 5)
    whole = pa.concat_tables(t for _, t in read_shards(files, shards, ["id", "prompt"]))
    assert whole.column("prompt").to_pylist() == [str(p) for p in rows["prompt"]]
    for shard in shards[3:]:  # each late part alone, as a resumed run or a Ray worker reads it
        ((_, alone),) = read_shards(files, [shard], ["id", "prompt"])
        assert alone.column("id").to_pylist() == list(range(shard.start, shard.stop))


def test_lines_longer_than_a_chunk_keep_their_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr(text_lines, "CHUNK_BYTES", 3)
    data = b"ab\r\ncdefghij\n\nxyz"
    assert list(text_lines.read_lines(io.BytesIO(data))) == [
        (1, 0, b"ab\r"),
        (2, 4, b"cdefghij"),
        (3, 13, b""),
        (4, 14, b"xyz"),
    ]
    assert next(text_lines.read_lines(io.BytesIO(data), 4, 2)) == (2, 4, b"cdefghij")  # from a seek point
    records = list(text_lines.jsonl_records(io.BytesIO(data)))
    assert [(r.line, r.offset, r.text) for r in records] == [(1, 0, "ab"), (2, 4, "cdefghij"), (4, 14, "xyz")]
    two_line = b'a,b\n1,"x\ny"\n2,z\n'
    rows = list(text_lines.csv_records(io.BytesIO(two_line)))
    assert [(r.line, r.offset, r.text) for r in rows] == [
        (1, 0, ["a", "b"]),
        (2, 4, ["1", "x\ny"]),
        (4, 12, ["2", "z"]),
    ]


def test_resume_and_shards_of_a_jsonl_input(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = str(_write_jsonl(tmp_path / "in.jsonl", _rows()))
    _run(tmp_path, tiny_model_dir, path, tmp_path / "full")
    expected = _read(tmp_path / "full")
    for shard in ("0/2", "1/2"):  # two static shards write one output; the last one completes it
        _run(tmp_path, tiny_model_dir, path, tmp_path / "sharded", "--shard", shard)
    assert _read(tmp_path / "sharded") == expected
    (tmp_path / "full" / "part-000002.parquet").unlink()  # a lost part: the rerun redoes it alone
    (tmp_path / "full" / "_SUCCESS").unlink()
    _run(tmp_path, tiny_model_dir, path, tmp_path / "full")
    assert _read(tmp_path / "full") == expected


def test_csv_and_dataset_inputs_on_an_object_store(tmp_path: Path, tiny_model_dir: Path) -> None:
    local = tmp_path / "local"
    _run(tmp_path, tiny_model_dir, str(_write_csv(tmp_path / "in.csv", _rows())), local)
    _write_dataset(tmp_path / "ds", _rows())
    with moto_s3() as s3:
        with s3["fs"].open_output_stream("inputs/data/in.csv") as out:
            out.write((tmp_path / "in.csv").read_bytes())
        for f in (tmp_path / "ds").iterdir():
            with s3["fs"].open_output_stream(f"inputs/ds/{f.name}") as out:
                out.write(f.read_bytes())
        for uri, name in (("s3://inputs/data", "from-csv"), ("s3://inputs/ds", "from-ds")):
            fmt = {"format": "csv"} if name == "from-csv" else {}  # a prefix: input.format names the files
            _run(tmp_path, tiny_model_dir, uri, tmp_path / name, storage_options=options(s3), **fmt)
            assert _read(tmp_path / name) == _read(local), name
    shutil.rmtree(tmp_path / "ds")
