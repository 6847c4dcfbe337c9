"""Job-level and per-row settings through the CLI: values that can never work fail at load (exit 2)
or become error rows; a bad device is exit 2 (not a name) or 4 (not here); messages say where a
value came from (file line or --set)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import make_job, output_table, write_job, write_parquet


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _job(
    tmp_path: Path,
    model_dir: Path,
    columns: dict[str, list[Any]] | None = None,
    schema: pa.Schema | None = None,
    **sections: dict[str, Any],
) -> Path:
    data = columns or {"id": ["a", "b"], "prompt": ["the cat", "a dog"]}
    write_parquet(tmp_path / "in.parquet", data, schema)
    model = sections.pop("model", {})  # why apart: make_job's first parameter is called model
    job = make_job(model_dir, str(tmp_path / "in.parquet"), tmp_path / "out", **sections)
    job["model"].update(model)
    return write_job(tmp_path / "job.yaml", job)


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    return output_table(tmp_path / "out").to_pylist()


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ('sampling.stop=[""]', "sampling.stop", "a list of non-empty strings"),
        ("sampling.stop_token_ids=[-1]", "sampling.stop_token_ids", "non-negative token ids"),
        ("sampling.seed=18446744073709551616", "sampling.seed", "fits 64 bits"),
        ("sampling.temperature=.nan", "sampling.temperature", "must be a finite number"),
        ("sampling.top_p=.inf", "sampling.top_p", "a number in (0, 1]"),
        ("sampling.min_tokens=9", "sampling.min_tokens", "max_tokens=8"),
    ],
)
def test_job_level_values_that_can_never_work_fail_at_load(
    tmp_path: Path, tiny_model_dir: Path, override: str, key: str, expected: str
) -> None:
    job = _job(tmp_path, tiny_model_dir)
    for command in ("validate", "run"):
        code, text = _cli(command, str(job), "--set", override)
        assert code == 2, text
        assert key in text and expected in text and "per-row" not in text
        assert f"(--set {override})" in text  # the value came from --set, not from the file
    assert not (tmp_path / "out").exists()


def test_set_error_does_not_cite_the_files_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir)  # the file's sampling.max_tokens is 8, on some line
    code, text = _cli("validate", str(job), "--set", "sampling.max_tokens=-1")
    assert code == 2
    must = "must be null (up to the context) or an integer >= 0"
    assert f"{job} (--set sampling.max_tokens=-1): sampling.max_tokens: {must}" in text
    assert f"{job}:" not in text


@pytest.mark.parametrize(
    "override, problem, input_section",
    [
        ("samplng.max_tokens=4", "samplng: unknown key (did you mean sampling?)", {}),
        ("sampling.max_tokenz=4", "sampling.max_tokenz: unknown key (did you mean max_tokens?)", {}),
        ("input.prompt_column=id", "input: set exactly one of", {"messages_column": "m"}),
        ("input.sampling_columns={n: id}", "input: input.sampling_columns: 'n' cannot", {}),
    ],
)
def test_an_error_a_set_causes_names_the_set_not_a_line_of_the_file(
    tmp_path: Path, tiny_model_dir: Path, override: str, problem: str, input_section: dict[str, Any]
) -> None:
    job = _job(tmp_path, tiny_model_dir, input={"prompt_column": None, **input_section})
    for command in ("validate", "run", "estimate"):
        code, text = _cli(command, str(job), "--set", override)
        assert code == 2, text
        assert f"{job} (--set {override}): {problem}" in text
        assert f"{job}:" not in text  # no line of the file: the file alone is valid
    assert not (tmp_path / "out").exists()


def test_a_section_error_of_the_file_itself_still_names_its_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir, input={"messages_column": "m"})  # and prompt_column: both set
    code, text = _cli("validate", str(job), "--set", "input.limit=5")
    assert code == 2 and "set exactly one of" in text
    assert f"{job}:3: input:" in text and "--set" not in text


@pytest.mark.parametrize("command", ["validate", "estimate", "run"])
@pytest.mark.parametrize("from_set", [False, True])
def test_a_max_model_len_beyond_the_models_positions_is_a_job_error_before_any_work(
    tmp_path: Path, tiny_model_dir: Path, command: str, from_set: bool
) -> None:
    engine = {} if from_set else {"max_model_len": 4096}
    job = _job(tmp_path, tiny_model_dir, engine=engine)  # the model has 256 positions
    line = next(i for i, text in enumerate(job.read_text().splitlines(), 1) if "window_rows" in text)
    code, text = _cli(command, str(job), *(["--set", "engine.max_model_len=4096"] if from_set else []))
    assert code == 2, text
    where = f"{job} (--set engine.max_model_len=4096)" if from_set else f"{job}:{line + 1}"
    assert f"{where}: engine.max_model_len: max_model_len=4096 exceeds the model's max_position_embeddings=256" in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["validate", "estimate", "run"])
@pytest.mark.parametrize(
    "sampling",
    [{"logit_bias": {5: 1.0, 100000: 5.0, 999999: -1.0}}, {"allowed_token_ids": [5, 100000, 999999]}],
)
def test_a_job_level_token_id_outside_the_vocabulary_is_a_job_error_before_any_work(
    tmp_path: Path, tiny_model_dir: Path, command: str, sampling: dict[str, Any]
) -> None:
    job = _job(tmp_path, tiny_model_dir, sampling=sampling, engine={"backend": "native"})
    code, text = _cli(command, str(job))
    assert code == 2, text
    key = next(iter(sampling))
    assert f"{job}:" in text and f"sampling.{key}: token ids [100000, 999999] are outside the model's" in text
    assert not (tmp_path / "out").exists()


def test_nan_in_the_file_says_finite(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir)
    job.write_text(job.read_text().replace("max_tokens: 8", "max_tokens: 8\n  temperature: .nan"))
    code, text = _cli("validate", str(job))
    assert code == 2 and "sampling.temperature: must be a finite number >= 0" in text
    assert "greater than or equal" not in text


@pytest.mark.parametrize("device", ["banana", "cuda:x", "gpu"])
def test_a_device_that_is_not_a_name_is_a_job_file_error(tmp_path: Path, tiny_model_dir: Path, device: str) -> None:
    code, text = _cli("validate", str(_job(tmp_path, tiny_model_dir, model={"device": device})))
    assert code == 2 and "model.device" in text and "cuda:N" in text


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_device_not_on_this_machine_is_a_model_error(tmp_path: Path, tiny_model_dir: Path, command: str) -> None:
    job = _job(tmp_path, tiny_model_dir, model={"device": "cuda:63"})
    code, text = _cli(command, str(job), *(["--quiet"] if command == "run" else []))
    assert code == 4, text
    assert "'cuda:63' is not available on this machine" in text and "cpu" in text.split("devices here:")[1]


def test_per_row_values_that_cannot_work_become_error_rows(tmp_path: Path, tiny_model_dir: Path) -> None:
    columns = {
        "id": ["ok", "min>max", "inf", "big-seed", "clamped"],
        "prompt": ["the cat"] * 5,
        "mt": [4, 2, None, None, None],
        "mn": [None, 3, None, None, 30],
        "temp": [None, None, float("inf"), None, None],
        "seed": [None, None, None, 1e20, None],
    }
    cols = {"max_tokens": "mt", "min_tokens": "mn", "temperature": "temp", "seed": "seed"}
    # max_model_len 12: the "clamped" row's max_tokens (the job's 40) is cut by the context to
    # fit, and its min_tokens 30 follows it down (as in vLLM): the row asked nothing inconsistent
    job = _job(
        tmp_path,
        tiny_model_dir,
        columns,
        input={"sampling_columns": cols},
        sampling={"max_tokens": 40},
        engine={"max_model_len": 12},
    )
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    rows = {r["id"]: r for r in _rows(tmp_path)}
    assert rows["ok"]["error_code"] is None and rows["clamped"]["error_code"] is None
    assert rows["clamped"]["output_tokens"] >= 1
    for bad, field in (("min>max", "min_tokens"), ("inf", "temperature"), ("big-seed", "seed")):
        assert rows[bad]["error_code"] == "invalid_sampling", bad
        assert field in rows[bad]["error_message"]


def test_a_text_sampling_column_is_refused_before_work(tmp_path: Path, tiny_model_dir: Path) -> None:
    columns = {"id": ["a", "b"], "prompt": ["the cat", "a dog"], "mt": ["5", "6"]}
    job = _job(tmp_path, tiny_model_dir, columns, input={"sampling_columns": {"max_tokens": "mt"}})
    for command in ("validate", "run"):
        code, text = _cli(command, str(job))
        assert code == 3, text
        assert f"{tmp_path / 'in.parquet'}: column 'mt' (input.sampling_columns.max_tokens)" in text
    assert not (tmp_path / "out").exists()


def test_whole_floats_are_integers_and_fractions_are_error_rows(tmp_path: Path, tiny_model_dir: Path) -> None:
    # what pandas writes for an integer column with nulls: float64 with 2.0 and NaN/null
    columns = {"id": ["whole", "null", "fraction"], "prompt": ["the cat"] * 3, "mt": [2.0, None, 2.5]}
    job = _job(
        tmp_path,
        tiny_model_dir,
        columns,
        input={"sampling_columns": {"max_tokens": "mt"}},
        sampling={"max_tokens": 8, "ignore_eos": True},
    )
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    rows = {r["id"]: r for r in _rows(tmp_path)}
    assert rows["whole"]["error_code"] is None and rows["whole"]["output_tokens"] == 2
    assert rows["null"]["error_code"] is None and rows["null"]["output_tokens"] == 8
    assert rows["fraction"]["error_code"] == "invalid_sampling" and "2.5" in rows["fraction"]["error_message"]


def test_prompt_column_defaults_to_prompt(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir)
    job.write_text(job.read_text().replace("  prompt_column: prompt\n", ""))
    assert "prompt_column" not in yaml.safe_load(job.read_text())["input"]
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    assert [r["error_code"] for r in _rows(tmp_path)] == [None, None]
