"""LoRA adapters in a job file, refused before any work: the keys against each other, the task and
the backend (exit 2, at the key), and every adapter folder against the model (`validate`,
`estimate`, `run`: a missing folder, DoRA, a target the model lacks: exit 4 naming the key and the
path; a rank above engine.max_lora_rank: exit 2 naming the key and the adapter). Nothing is created
in the output folder. The fingerprint names each adapter's content hash."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.job.spec import load_job
from batchgen.outputs.fingerprint import describe_difference, job_fingerprint
from testkit.tiny_lora import save_tiny_adapter
from tests.conftest import make_job, write_job, write_parquet


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("lora-checks")
    save_tiny_adapter(tiny_model_dir, tmp / "r4", r=4)
    save_tiny_adapter(tiny_model_dir, tmp / "r8", r=8, alpha=16, target_modules=("q_proj", "up_proj"), seed=1)
    save_tiny_adapter(tiny_model_dir, tmp / "dora", r=4, use_dora=True)
    write_parquet(tmp / "in.parquet", {"id": ["a", "b"], "prompt": ["once upon", "the cat"], "adapter": ["r4", None]})
    return tmp


def _job(tmp: Path, model: Path, lora: dict[str, str], name: str = "job", **sections: dict[str, Any]) -> Path:
    job = make_job(model, str(tmp / "in.parquet"), tmp / f"out-{name}", engine={"backend": "native"})
    job["model"]["lora"] = lora
    job["input"]["lora_column"] = "adapter"
    for section, values in sections.items():
        job.setdefault(section, {}).update(values)
    return write_job(tmp / f"{name}.yaml", job)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_a_good_job_validates_and_lists_its_adapters(adapters: Path, tiny_model_dir: Path) -> None:
    job = _job(adapters, tiny_model_dir, {"r4": str(adapters / "r4"), "r8": str(adapters / "r8")})
    code, text = _cli("validate", str(job))
    assert code == 0, text
    assert "model.lora.r4: rank 4" in text and "model.lora.r8: rank 8" in text


@pytest.mark.parametrize("command", ["validate", "estimate", "run"])
def test_a_missing_adapter_folder_fails_before_any_work(adapters: Path, tiny_model_dir: Path, command: str) -> None:
    missing = adapters / "no-such-adapter"
    job = _job(adapters, tiny_model_dir, {"r4": str(adapters / "r4"), "gone": str(missing)}, name=f"gone-{command}")
    code, text = _cli(command, str(job))
    assert code == 4, text
    assert "model.lora.gone" in text and str(missing) in text and "no such folder" in text
    assert not (adapters / f"out-gone-{command}").exists()  # nothing was written


def test_a_rank_above_max_lora_rank_is_a_job_value_error(adapters: Path, tiny_model_dir: Path) -> None:
    job = _job(adapters, tiny_model_dir, {"r8": str(adapters / "r8")}, name="rank", engine={"max_lora_rank": 4})
    code, text = _cli("validate", str(job))
    assert code == 2, text
    assert "engine.max_lora_rank 4" in text and "'r8'" in text and "rank 8" in text and "rank.yaml:" in text


def test_max_cpu_loras_below_max_loras_is_a_job_value_error(adapters: Path, tiny_model_dir: Path) -> None:
    lora = {"r4": str(adapters / "r4"), "r8": str(adapters / "r8")}
    job = _job(adapters, tiny_model_dir, lora, name="cpu", engine={"max_cpu_loras": 1})
    code, text = _cli("validate", str(job))
    assert code == 2, text
    assert "engine.max_cpu_loras 1 is below engine.max_loras 2" in text and "cpu.yaml:" in text


def test_max_lora_rank_and_max_loras_default_from_the_adapters(adapters: Path, tiny_model_dir: Path) -> None:
    from batchgen.job.adapters import read_adapters

    job = _job(adapters, tiny_model_dir, {"r4": str(adapters / "r4"), "r8": str(adapters / "r8")}, name="defaults")
    read = read_adapters(load_job(job))
    assert read is not None and (read.max_loras, read.max_lora_rank) == (2, 8)
    assert read.engine_settings()["enable_lora"] is True
    many = {f"a{i}": str(adapters / "r4") for i in range(10)}
    read = read_adapters(load_job(_job(adapters, tiny_model_dir, many, name="many")))
    assert read is not None and read.max_loras == 8  # the job's adapter count, at most 8


def test_dora_is_refused_by_name(adapters: Path, tiny_model_dir: Path) -> None:
    job = _job(adapters, tiny_model_dir, {"d": str(adapters / "dora")}, name="dora")
    for command in ("validate", "estimate"):
        code, text = _cli(command, str(job))
        assert code == 4, text
        assert "model.lora.d" in text and "use_dora" in text


def test_a_target_the_model_lacks_is_refused(adapters: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    odd = shutil.copytree(adapters / "r4", tmp_path / "odd")
    weights = odd / "adapter_model.safetensors"
    from safetensors.torch import load_file, save_file

    tensors = {k.replace("q_proj", "qkv_fused"): v for k, v in load_file(weights).items()}
    save_file(tensors, weights)
    job = _job(adapters, tiny_model_dir, {"odd": str(odd)}, name="odd")
    code, text = _cli("validate", str(job))
    assert code == 4, text
    assert "model.lora.odd" in text and "qkv_fused" in text


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        ({"model": {"lora": {}}}, "input.lora_column", "sets no model.lora"),
        ({"engine": {"backend": "hf"}}, "model.lora", "engine.backend native"),
        ({"engine": {"enable_lora": True}}, "engine.enable_lora", "not a job key: model.lora turns adapters on"),
        ({"input": {"lora_column": None}}, "input.lora_column", "name the column"),
        ({"engine": {"tensor_parallel_size": 2}}, "engine.tensor_parallel_size", "adapters run on one device"),
    ],
)
def test_lora_keys_that_do_not_fit_are_refused_at_their_key(
    adapters: Path, tiny_model_dir: Path, change: dict[str, dict[str, Any]], key: str, words: str
) -> None:
    job = _job(adapters, tiny_model_dir, {"r4": str(adapters / "r4")}, name="keys")
    text = job.read_text()
    import yaml

    data = yaml.safe_load(text)
    for section, values in change.items():
        data[section].update(values)
    job.write_text(yaml.safe_dump(data))
    code, out = _cli("validate", str(job))
    assert code == 2, out
    assert key in out and words in out


def test_a_pooling_task_with_adapters_is_refused(adapters: Path, tiny_model_dir: Path) -> None:
    job = _job(adapters, tiny_model_dir, {"r4": str(adapters / "r4")}, name="embed", sampling={})
    import yaml

    data = yaml.safe_load(job.read_text())
    data["task"] = "embed"
    data.pop("sampling")
    job.write_text(yaml.safe_dump(data))
    code, out = _cli("validate", str(job))
    assert code == 2, out
    assert "model.lora" in out and "task embed runs the base model only" in out


def test_max_loras_without_adapters_is_refused(adapters: Path, tiny_model_dir: Path) -> None:
    job = make_job(tiny_model_dir, str(adapters / "in.parquet"), adapters / "out-x", engine={"max_loras": 2})
    code, out = _cli("validate", str(write_job(adapters / "x.yaml", job)))
    assert code == 2, out
    assert "engine.max_loras" in out and "read only with model.lora" in out


def test_the_fingerprint_names_each_adapter_by_content(adapters: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(adapters / "r4", tmp_path / "a")
    job = _job(adapters, tiny_model_dir, {"a": str(folder)}, name="fp")
    spec = load_job(job)
    files: list[Any] = []  # (the inputs' part of the fingerprint is not the point here)
    before = job_fingerprint(spec, files)
    moved = shutil.copytree(folder, tmp_path / "elsewhere")
    spec_moved = load_job(job, [f"model.lora.a={moved}"])
    assert job_fingerprint(spec_moved, files)["id"] == before["id"]  # where it lies is no part of it
    save_tiny_adapter(tiny_model_dir, folder, r=4, seed=7)  # same name, other weights
    after = job_fingerprint(load_job(job), files)
    assert after["id"] != before["id"]
    assert "LoRA adapter a changed (its files' content differs)" in describe_difference(before, after)


def test_a_job_without_adapters_keeps_its_fingerprint(adapters: Path, tiny_model_dir: Path) -> None:
    job = write_job(adapters / "plain.yaml", make_job(tiny_model_dir, str(adapters / "in.parquet"), adapters / "o"))
    fp = job_fingerprint(load_job(job), [])
    assert "lora" not in fp
    assert "lora_column" not in fp["settings"]["input"] and "lora" not in fp["settings"]["model"]
    assert not {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras"} & set(fp["settings"]["engine"])
