"""The job file: strict validation with key names and line numbers, overrides, path resolution."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest
from pydantic import ValidationError, create_model

from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import SamplingParams
from batchgen.errors import JobFileError
from batchgen.job.sections import _Strict
from batchgen.job.spec import JOB_DEFAULTS, EngineSection, SamplingSection, _derived_fields, load_job

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
    [
        ("  max_tokens: -1", "sampling.max_tokens"),
        ("  max_tokens: ten", "sampling.max_tokens"),
        ("  temperature: -1", "sampling.temperature"),
        ("  top_p: 1.5", "sampling.top_p"),
    ],
)
def test_wrong_type_or_range_is_rejected(tmp_path: Path, line: str, key: str) -> None:
    text = GOOD.replace("  max_tokens: 32", line)
    with pytest.raises(JobFileError, match=key):
        load_job(_write(tmp_path, text))


def test_missing_section_and_both_prompt_sources(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match="output: Field required"):
        load_job(_write(tmp_path, GOOD.replace("output:\n  path: out\n", "")))
    with pytest.raises(JobFileError, match=r"exactly one of input\.prompt_column or input\.messages_column"):
        load_job(_write(tmp_path, GOOD.replace("  prompt_column: prompt", "  prompt_column: p\n  messages_column: m")))


def test_sampling_columns_only_for_overridable_fields(tmp_path: Path) -> None:
    # (n shapes the output columns, so it is one value for the whole job; stop may be set per row)
    text = GOOD.replace("  prompt_column: prompt", "  prompt_column: prompt\n  sampling_columns: {n: s}")
    with pytest.raises(JobFileError, match="'n' cannot be set per row"):
        load_job(_write(tmp_path, text))


def test_a_python_api_setting_in_a_job_file_is_refused_saying_what_to_do(tmp_path: Path) -> None:
    """Engine / sampling fields marked no job key (field metadata) are refused at their key with what
    a job does instead, not a bare "unknown key" (with adapters or without)."""
    with pytest.raises(JobFileError) as err:
        load_job(_write(tmp_path, GOOD + "engine:\n  enable_lora: true\n"))
    assert "engine.enable_lora: not a job key: model.lora turns adapters on" in str(err.value)
    with pytest.raises(JobFileError, match=r"sampling\.detokenize: not a job key: a setting of the Python API"):
        load_job(_write(tmp_path, GOOD), ["sampling.detokenize=false"])


def test_set_overrides_parse_values_as_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    spec = load_job(path, ["sampling.max_tokens=64", "sampling.stop=[a, b]", "engine.backend=hf"])
    assert spec.sampling.max_tokens == 64 and spec.sampling.stop == ["a", "b"] and spec.engine.backend == "hf"
    with pytest.raises(JobFileError, match=r"sampling\.max_tokens"):
        load_job(path, ["sampling.max_tokens=-1"])
    with pytest.raises(JobFileError, match=r"expected section\.key=value"):
        load_job(path, ["sampling.max_tokens"])
    with pytest.raises(JobFileError, match=r"engine\.nope: unknown key"):
        load_job(path, ["engine.nope=1"])


def test_unreadable_and_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match="cannot read the job file"):
        load_job(tmp_path / "missing.yaml")
    with pytest.raises(JobFileError, match="not valid YAML"):
        load_job(_write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(JobFileError, match="must be a mapping"):
        load_job(_write(tmp_path, "- a\n- b\n"))


def test_sections_are_derived_from_the_engine_dataclasses() -> None:
    """One source: every EngineConfig / SamplingParams field is a job key with the engine's
    default, except the differences stated in JOB_DEFAULTS and the MiB spelling of the KV budget."""
    engine, sampling = EngineSection(), SamplingSection()
    engine_only = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("job") is False}
    assert engine_only == {"enable_lora"}  # model.lora turns adapters on
    assert not engine_only & set(EngineSection.model_fields)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "kv_cache_memory_bytes":
            assert engine.kv_cache_memory_mb is None
        elif f.name not in engine_only:
            assert getattr(engine, f.name) == f.default, f.name
    assert set(engine.engine_settings()) == {f.name for f in dataclasses.fields(EngineConfig)} - engine_only
    defaults = SamplingParams()
    python_only = {f.name for f in dataclasses.fields(SamplingParams) if f.metadata.get("job") is False}
    assert python_only == {"detokenize", "spaces_between_special_tokens", "structured_outputs"}
    assert not python_only & set(SamplingSection.model_fields)  # vLLM's Python API only: no job keys
    for f in dataclasses.fields(SamplingParams):
        if f.name not in python_only:
            want = JOB_DEFAULTS["sampling"].get(f.name, getattr(defaults, f.name))
            assert getattr(sampling, f.name) == want, f.name
    assert sampling.to_params() == SamplingParams(max_tokens=128, temperature=0.0)


def test_a_field_added_to_the_engine_config_appears_in_the_job_file() -> None:
    @dataclasses.dataclass(frozen=True)
    class WithNewField(EngineConfig):
        decode_kv: Literal["gathered", "rows"] | None = None

    section = create_model("S", __base__=_Strict, **_derived_fields(WithNewField, "engine"))
    assert section(decode_kv="rows").decode_kv == "rows" and section().decode_kv is None
    with pytest.raises(ValidationError):
        section(decode_kv="banana")


def test_engine_checks_and_units(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "engine:\n  kv_cache_memory_mb: 2\n  block_size: 0\n")
    with pytest.raises(JobFileError, match=r"job.yaml:12: engine.block_size: must be null or an integer >= 1"):
        load_job(path)
    spec = load_job(path, ["engine.block_size=8"])
    assert spec.engine.engine_settings()["kv_cache_memory_bytes"] == 2 << 20
    assert spec.engine.to_config().block_size == 8


def test_top_k_minus_one_is_valid_in_the_job_and_the_engine(tmp_path: Path) -> None:
    spec = load_job(_write(tmp_path, GOOD + "  top_k: -1\n"))
    assert spec.sampling.to_params().top_k == 0 == SamplingParams(top_k=-1).top_k


def test_device_names(tmp_path: Path) -> None:
    for device in ("auto", "cpu", "cuda", "cuda:1", "mps"):
        assert load_job(_write(tmp_path, GOOD), [f"model.device={device}"]).model.device == device
    with pytest.raises(JobFileError, match=r"model.device: must be auto, cpu, cuda, cuda:N"):
        load_job(_write(tmp_path, GOOD), ["model.device=banana"])


def test_prompt_column_default_and_messages(tmp_path: Path) -> None:
    spec = load_job(_write(tmp_path, GOOD.replace("  prompt_column: prompt\n", "")))
    assert spec.input.prompt_column == "prompt"
    spec = load_job(_write(tmp_path, GOOD.replace("  prompt_column: prompt\n", "  messages_column: m\n")))
    assert spec.input.prompt_column is None and spec.input.messages_column == "m"


def test_gpu_memory_utilization_in_the_job_file(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "engine:\n  gpu_memory_utilization: 1.5\n")
    with pytest.raises(JobFileError, match=r"job.yaml:11: engine.gpu_memory_utilization: must be a number in \(0, 1\]"):
        load_job(path)
    for text, value in (("0.5", 0.5), ("1", 1)):
        spec = load_job(_write(tmp_path, GOOD + f"engine:\n  gpu_memory_utilization: {text}\n"))
        assert spec.engine.to_config().gpu_memory_utilization == value
    assert load_job(_write(tmp_path, GOOD)).engine.to_config().max_num_seqs is None  # the device decides


def test_a_duplicate_section_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "sampling:\n  temperature: 0.5\n")  # a second sampling: at line 10
    with pytest.raises(JobFileError) as err:
        load_job(path)
    assert f"{path}:10: sampling: duplicate key (first at line 8)" in str(err.value)


def test_a_duplicate_key_in_a_section_is_refused_naming_both_lines(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD + "  max_tokens: 16\n")
    with pytest.raises(JobFileError) as err:
        load_job(path)
    assert f"{path}:10: sampling.max_tokens: duplicate key (first at line 9)" in str(err.value)


def test_a_duplicate_key_in_a_set_value_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match=r"--set 'sampling.logit_bias=\{5: 1, 5: 2\}': 5: duplicate key"):
        load_job(_write(tmp_path, GOOD), ["sampling.logit_bias={5: 1, 5: 2}"])


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD.replace("  max_tokens: 32", "  <<: {max_tokens: 8, top_k: 5}\n  max_tokens: 32"))
    spec = load_job(path)
    assert spec.sampling.max_tokens == 32 and spec.sampling.top_k == 5


def test_a_section_with_every_key_commented_out_is_an_empty_section(tmp_path: Path) -> None:
    text = GOOD.replace("  max_tokens: 32\n", "  # max_tokens: 32\n") + "engine:\n  # window_rows: 8\nexecutor:\n"
    spec = load_job(_write(tmp_path, text))
    assert spec.sampling.max_tokens == 128 and spec.engine.window_rows == 1024 and spec.executor.kind == "local"
    assert load_job(_write(tmp_path, text), ["engine.window_rows=8"]).engine.window_rows == 8  # --set into it
    with pytest.raises(JobFileError) as err:
        load_job(_write(tmp_path, GOOD.replace("  path: out\n", "  # path: out\n")))
    assert "job.yaml:6: output.path: Field required" in str(err.value) and "Section" not in str(err.value)


@pytest.mark.parametrize(
    "line, overrides, expected",
    [
        ("  stop: [no]", [], "sampling.stop.0: Input should be a valid string (YAML 1.1 reads an unquoted no (line 9)"),
        ("  structured: {choice: [yes, no]}", [], "sampling.structured: must be null or a mapping"),
        ("  structured: {choice: [yes, no]}", [], 'reads an unquoted yes (line 9) as a boolean: quote it, "yes"'),
        ("  max_tokens: 32", ["sampling.stop=[On]"], 'reads an unquoted On as a boolean: quote it, "On")'),
    ],
)
def test_a_yes_or_no_that_yaml_read_as_a_boolean_is_named(
    tmp_path: Path, line: str, overrides: list[str], expected: str
) -> None:
    with pytest.raises(JobFileError) as err:
        load_job(_write(tmp_path, GOOD.replace("  max_tokens: 32", line)), overrides)
    assert expected in str(err.value)


def test_a_boolean_meant_as_one_gets_no_quoting_hint(tmp_path: Path) -> None:
    with pytest.raises(JobFileError) as err:
        load_job(_write(tmp_path, GOOD.replace("  max_tokens: 32", "  ignore_eos: yes\n  top_p: 7")))
    assert "sampling.top_p" in str(err.value) and "YAML 1.1" not in str(err.value)
    assert load_job(_write(tmp_path, GOOD.replace("  max_tokens: 32", "  ignore_eos: yes"))).sampling.ignore_eos
