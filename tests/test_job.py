"""The job file: strict validation with key names and line numbers, overrides, path resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen.errors import JobFileError
from batchgen.job import load_job

GOOD = """\
model:
  path: models/m
input:
  path: data/*.parquet
  prompt_column: prompt
output:
  path: out
sampling:
  max_tokens: 32
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_relative_paths_resolve_against_the_job_files_folder(tmp_path: Path) -> None:
    spec = load_job(_write(tmp_path, GOOD))
    assert spec.model.path == (tmp_path / "models/m").resolve()
    assert spec.output.path == (tmp_path / "out").resolve()
    assert spec.input.path == str(tmp_path / "data/*.parquet")
    assert spec.engine.backend == "native" and spec.sampling.temperature == 0.0


def test_unknown_key_is_named_with_its_line(tmp_path: Path) -> None:
    with pytest.raises(JobFileError) as err:
        load_job(_write(tmp_path, GOOD + "  max_tokenz: 5\n"))
    assert "sampling.max_tokenz: unknown key" in str(err.value)
    assert f"{tmp_path / 'job.yaml'}:10" in str(err.value)


@pytest.mark.parametrize(
    "line, key",
    [("  max_tokens: 0", "sampling.max_tokens"), ("  max_tokens: ten", "sampling.max_tokens"),
     ("  temperature: -1", "sampling.temperature"), ("  top_p: 1.5", "sampling.top_p")],
)
def test_wrong_type_or_range_is_rejected(tmp_path: Path, line: str, key: str) -> None:
    text = GOOD.replace("  max_tokens: 32", line)
    with pytest.raises(JobFileError, match=key):
        load_job(_write(tmp_path, text))


def test_missing_section_and_both_prompt_sources(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match="output: Field required"):
        load_job(_write(tmp_path, GOOD.replace("output:\n  path: out\n", "")))
    with pytest.raises(JobFileError, match="exactly one of input.prompt_column or input.messages_column"):
        load_job(_write(tmp_path, GOOD.replace("  prompt_column: prompt", "  prompt_column: p\n  messages_column: m")))


def test_sampling_columns_only_for_overridable_fields(tmp_path: Path) -> None:
    text = GOOD.replace("  prompt_column: prompt", "  prompt_column: prompt\n  sampling_columns: {stop: s}")
    with pytest.raises(JobFileError, match="'stop' cannot be set per row"):
        load_job(_write(tmp_path, text))


def test_set_overrides_parse_values_as_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    spec = load_job(path, ["sampling.max_tokens=64", "sampling.stop=[a, b]", "engine.backend=hf"])
    assert spec.sampling.max_tokens == 64 and spec.sampling.stop == ["a", "b"] and spec.engine.backend == "hf"
    with pytest.raises(JobFileError, match="sampling.max_tokens"):
        load_job(path, ["sampling.max_tokens=0"])
    with pytest.raises(JobFileError, match="expected section.key=value"):
        load_job(path, ["sampling.max_tokens"])
    with pytest.raises(JobFileError, match="engine.nope: unknown key"):
        load_job(path, ["engine.nope=1"])


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match="cannot read the job file"):
        load_job(tmp_path / "missing.yaml")
    with pytest.raises(JobFileError, match="not valid YAML"):
        load_job(_write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(JobFileError, match="must be a mapping"):
        load_job(_write(tmp_path, "- a\n- b\n"))
