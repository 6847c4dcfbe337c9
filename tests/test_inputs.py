"""Input discovery, schemas and ids through the CLI: carried columns checked in every file before
any work, unique row_ids for nested folders, prompt/messages column types, a fingerprint that does
not depend on where the data is mounted, an output folder inside the input folder, null ids."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import make_job, write_job, write_parquet


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _run(job: Path) -> tuple[int, str]:
    return _cli("run", str(job), "--quiet")


def _rows(out: Path) -> list[dict]:
    return ds.dataset(out, format="parquet").to_table().to_pylist()


def test_a_carried_column_missing_from_a_later_file_fails_before_any_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_parquet(tmp_path / "d" / "a.parquet", {"id": ["1", "2"], "prompt": ["the cat"] * 2, "topic": ["x", "y"]})
    write_parquet(tmp_path / "d" / "b.parquet", {"id": ["3"], "prompt": ["a dog"]})
    out = tmp_path / "out"
    for i, carry in enumerate([None, ["id", "topic"]]):
        job = write_job(
            tmp_path / f"j{i}.yaml",
            make_job(
                tiny_model_dir, str(tmp_path / "d"), out, input={"carry_columns": carry}, engine={"window_rows": 1}
            ),
        )
        code, text = _run(job)
        assert code == 3, text
        assert f"{tmp_path / 'd' / 'b.parquet'}: no column 'topic'" in text
        assert not out.exists()  # refused before any part was committed
        assert _cli("validate", str(job))[0] == 3


def test_extra_or_retyped_carried_columns_fail_before_any_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    d = tmp_path / "d"
    write_parquet(d / "a.parquet", {"id": ["1"], "prompt": ["the cat"], "n": [1]})
    write_parquet(d / "b.parquet", {"id": ["2"], "prompt": ["a dog"], "n": ["one"]})
    out = tmp_path / "out"
    code, text = _run(write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(d), out)))
    assert code == 3 and f"{d / 'b.parquet'}: column 'n' is string but {d / 'a.parquet'} has int64" in text, text
    write_parquet(d / "b.parquet", {"id": ["2"], "prompt": ["a dog"], "n": [2], "more": [0.5]})
    code, text = _run(write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(d), out)))
    assert code == 3 and f"{d / 'b.parquet'}: column(s) ['more'] are not in {d / 'a.parquet'}" in text, text
    assert not out.exists()
    job = make_job(tiny_model_dir, str(d), out, input={"carry_columns": ["id", "n"]})
    assert _run(write_job(tmp_path / "j.yaml", job))[0] == 0  # naming the columns to carry is the fix
    assert [r["n"] for r in _rows(out)] == [1, 2]


def test_text_written_by_pandas_3_and_by_pyarrow_is_one_column_type(tmp_path: Path, tiny_model_dir: Path) -> None:
    """pandas 3 writes text as large_string, pyarrow as string, newer writers string_view: one input
    folder may hold all three (and binary-like variants likewise); they are read together, carried
    as the large variant, and a mix of kinds (text and numbers) is still refused."""
    d = tmp_path / "d"
    d.mkdir()
    frame = pd.DataFrame({"id": ["p0", "p1"], "prompt": ["the cat", "a dog"], "note": ["x", "y"], "raw": [b"1", b"2"]})
    frame.to_parquet(d / "a-pandas.parquet")
    assert pq.read_schema(d / "a-pandas.parquet").field("prompt").type == pa.large_string()  # what pandas 3 writes
    for name, text, raw in (("b", pa.string(), pa.large_binary()), ("c", pa.string_view(), pa.binary_view())):
        schema = pa.schema([("id", text), ("prompt", text), ("note", text), ("raw", raw)])
        row_id = "b0" if name == "b" else "p1"  # c's id repeats the pandas file's: duplicates are found across types
        columns = {"id": [row_id], "prompt": ["once upon a time"], "note": ["z"], "raw": [b"3"]}
        write_parquet(d / f"{name}.parquet", columns, schema=schema)
    out = tmp_path / "out"
    code, text = _run(write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(d), out)))
    assert code == 0, text
    table = ds.dataset(out, format="parquet").to_table()
    assert table.schema.field("note").type == pa.large_string() and table.schema.field("raw").type == pa.large_binary()
    rows = table.to_pylist()
    assert [(r["id"], r["note"], r["raw"], r["error_code"]) for r in rows] == [
        ("p0", "x", b"1", None),
        ("p1", "y", b"2", None),
        ("b0", "z", b"3", None),
        ("p1", "z", b"3", "duplicate_id"),
    ]
    write_parquet(d / "c.parquet", {"id": ["c0"], "prompt": ["x"], "note": [1], "raw": [b"3"]})
    code, text = _run(write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(d), tmp_path / "out2")))
    assert (
        code == 3 and f"{d / 'c.parquet'}: column 'note' is int64 but {d / 'a-pandas.parquet'} has large_string" in text
    )


def test_row_ids_are_unique_for_nested_folders_and_globs(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data"
    write_parquet(data / "x" / "part-0.parquet", {"prompt": ["the cat", "a dog"]})
    write_parquet(data / "y" / "part-0.parquet", {"prompt": ["her friend"]})
    expected = ["x/part-0.parquet:0", "x/part-0.parquet:1", "y/part-0.parquet:0"]
    for i, inputs in enumerate([str(data), str(data / "*" / "part-*.parquet"), str(data / "x" / "part-0.parquet")]):
        out = tmp_path / f"out{i}"
        job = make_job(tiny_model_dir, inputs, out, input={"id_column": None})
        code, text = _run(write_job(tmp_path / f"j{i}.yaml", job))
        assert code == 0, text
        got = [r["row_id"] for r in _rows(out)]
        assert got == (expected if i < 2 else ["part-0.parquet:0", "part-0.parquet:1"])


def test_a_prompt_column_of_integers_fails_before_any_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"id": ["1", "2"], "prompt": [3, 4]})
    out = tmp_path / "out"
    job = write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(data), out))
    for command in ("validate", "run"):
        code, text = _cli(command, str(job))
        assert code == 3 and f"{data}: input.prompt_column 'prompt' is int64" in text, text
    assert not out.exists()


def test_messages_with_a_model_that_has_no_chat_template_fail_before_any_work(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    model = shutil.copytree(tiny_model_dir, tmp_path / "no-template")
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_parquet(tmp_path / "in.parquet", {"id": ["1"], "messages": [[{"role": "user", "content": "hi"}]]})
    out = tmp_path / "out"
    job = make_job(model, str(data), out)
    job["input"] = {"path": str(data), "messages_column": "messages", "id_column": "id"}
    job_path = write_job(tmp_path / "j.yaml", job)
    for command in ("validate", "run"):
        code, text = _cli(command, str(job_path))
        assert code == 4 and "has no chat template" in text, text
    assert not out.exists()


def test_the_same_data_through_another_path_or_mount_is_the_same_job(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "jobs").mkdir()
    write_parquet(tmp_path / "in" / "sub" / "x.parquet", {"id": ["1", "2"], "prompt": ["the cat", "a dog"]})
    out = tmp_path / "out"
    first = make_job(tiny_model_dir, "../in", out)
    code, text = _run(write_job(tmp_path / "jobs" / "j.yaml", first))
    assert code == 0, text
    moved = shutil.copytree(tmp_path / "in", tmp_path / "mnt" / "elsewhere")
    for i, path in enumerate([str(tmp_path / "in"), str(moved)]):
        code, text = _run(write_job(tmp_path / f"j{i}.yaml", make_job(tiny_model_dir, path, out)))
        assert code == 0 and "nothing to do" in text, text
    inputs = json.loads((out / "_SUCCESS").read_text())["inputs"]
    assert inputs == [str(tmp_path / "in" / "sub" / "x.parquet")]  # normalised: no "jobs/.."
    write_parquet(moved / "sub" / "x.parquet", {"id": ["1", "2"], "prompt": ["the cat", "a cat"]})
    code, text = _run(write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(moved), out)))
    assert code == 2 and "input file changed (size or content): sub/x.parquet" in text, text


def test_an_output_folder_inside_the_input_folder_is_not_read_as_input(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data"
    write_parquet(data / "in.parquet", {"id": ["1", "2"], "prompt": ["the cat", "a dog"]})
    job = write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(data), data / "out"))
    assert _run(job)[0] == 0
    code, text = _cli("validate", str(job))
    assert code == 0 and "1 input file(s), 2 rows" in text, text
    code, text = _run(job)
    assert code == 0 and "nothing to do" in text, text
    assert len(_rows(data / "out")) == 2


def test_an_older_batchgen_output_inside_the_input_folder_is_skipped_and_logged(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older run's output (another output.path) left inside the input folder used to be read as
    input: its parts' rows ran again as duplicates, or the job failed on their extra columns."""
    data = tmp_path / "data"
    write_parquet(data / "in.parquet", {"id": ["1", "2"], "prompt": ["the cat", "a dog"]})
    old = write_job(tmp_path / "old.yaml", make_job(tiny_model_dir, str(data), data / "old_out"))
    assert _run(old)[0] == 0
    (data / "spark").mkdir()  # a Spark output: _SUCCESS and part files, but no _JOB.json: it is input
    write_parquet(data / "spark" / "part-000000.parquet", {"id": ["3"], "prompt": ["once upon a time"]})
    (data / "spark" / "_SUCCESS").write_text("")
    for carry in (None, ["id"]):
        out = tmp_path / f"out-{carry}"
        job = make_job(tiny_model_dir, str(data), out, input={"carry_columns": carry})
        with caplog.at_level(logging.WARNING, logger="batchgen.inputs.nested_outputs"):
            code, text = _run(write_job(tmp_path / "new.yaml", job))
        assert code == 0, text
        assert sorted(r["id"] for r in _rows(out)) == ["1", "2", "3"]
        assert f"{data}/old_out holds a batchgen output (_JOB.json): its 1 part file(s) are not read" in caplog.text
    named = make_job(tiny_model_dir, str(data / "old_out"), tmp_path / "second-pass", input={"carry_columns": ["id"]})
    code, text = _run(write_job(tmp_path / "second.yaml", named))
    assert code == 0 and sorted(r["id"] for r in _rows(tmp_path / "second-pass")) == ["1", "2"], text


def test_null_ids_are_missing_id_rows_and_duplicates_are_named_plainly(tmp_path: Path, tiny_model_dir: Path) -> None:
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string())])
    write_parquet(tmp_path / "d" / "a.parquet", {"id": [1, None, 2, None], "prompt": ["the cat"] * 4}, schema)
    write_parquet(tmp_path / "d" / "b.parquet", {"id": [2, 1], "prompt": ["a dog"] * 2}, schema)
    out = tmp_path / "out"
    code, text = _run(
        write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(tmp_path / "d"), out, engine={"window_rows": 2}))
    )
    assert code == 0, text
    rows = _rows(out)
    assert [r["error_code"] for r in rows] == [None, "missing_id", None, "missing_id", "duplicate_id", "duplicate_id"]
    assert rows[1]["error_message"].endswith("row 1 (id None): id is null")
    assert f"duplicate id 2: first used by {tmp_path / 'd' / 'a.parquet'} row 2" in rows[4]["error_message"]
    assert f"duplicate id 1: first used by {tmp_path / 'd' / 'a.parquet'} row 0" in rows[5]["error_message"]


def test_validate_counts_rows_after_the_limit_and_estimate_of_no_rows_prints_no_none(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = write_parquet(tmp_path / "in.parquet", {"id": [str(i) for i in range(5)], "prompt": ["the cat"] * 5})
    job = write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(data), tmp_path / "o", input={"limit": 2}))
    code, text = _cli("validate", str(job))
    assert code == 0 and "1 input file(s), 2 rows" in text, text
    empty = write_parquet(
        tmp_path / "empty.parquet", {"id": [], "prompt": []}, pa.schema([("id", pa.string()), ("prompt", pa.string())])
    )
    code, text = _cli(
        "estimate", str(write_job(tmp_path / "e.yaml", make_job(tiny_model_dir, str(empty), tmp_path / "o")))
    )
    assert code == 0, text
    assert "None" not in text and "input tokens" in text and "total 0" in text


def _file_lines(text: str) -> list[str]:
    """validate's lines under its first, less the one saying what model.dtype resolves to."""
    return [line for line in text.splitlines()[1:] if not line.startswith("  model.dtype")]


def test_validate_lists_the_input_files_and_what_it_reads_of_each(tmp_path: Path, tiny_model_dir: Path) -> None:
    d = tmp_path / "d"
    for i in range(25):
        write_parquet(d / f"f{i:02d}.parquet", {"id": [f"{i}-{j}" for j in range(3)], "prompt": ["the cat"] * 3})
    job = write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(d), tmp_path / "o"))
    code, text = _cli("validate", str(job))
    assert code == 0, text
    lines = text.splitlines()
    assert "25 input file(s), 75 rows" in lines[0]
    listed = [f"  {d / f'f{i:02d}.parquet'}: 3 rows" for i in range(20)]
    assert lines[1:-1] == [*listed, "  ... and 5 more file(s), 15 rows"]
    assert lines[-1].startswith("  model.dtype auto -> float32 (checkpoint stored in float32")
    code, text = _cli("validate", str(job), "--set", "input.limit=7")
    assert code == 0, text
    assert _file_lines(text) == [
        f"  {d / 'f00.parquet'}: 3 rows",
        f"  {d / 'f01.parquet'}: 3 rows",
        f"  {d / 'f02.parquet'}: 3 rows, reads the first 1 (input.limit)",
        "  ... and 22 more file(s), 66 rows, not read (input.limit)",
    ]
    code, text = _cli("validate", str(job), "--set", "input.limit=70")  # 24 files read, 1 not
    assert _file_lines(text)[-2:] == [
        "  ... and 4 more file(s), 12 rows",
        "  ... and 1 more file(s), 3 rows, not read (input.limit)",
    ]
