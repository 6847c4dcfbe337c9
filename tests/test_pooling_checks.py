"""What `validate` says about a job the model cannot serve, read from the model's config before any
work: a job value that does not fit the model is exit 2 naming the key, a folder that cannot serve
the task is exit 4; `run` refuses the same way before writing a part. And an explicit
`pooling.pooling_type` replaces a sentence-transformers Pooling module batchgen cannot apply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from testkit.pooling_models import save_llama_classifier, save_tiny_bert, write_sentence_transformers
from tests.conftest import build_tokenizer, write_job, write_parquet


def _job(tmp: Path, model: Path, task: str, **sections: dict[str, Any]) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    inputs = write_parquet(tmp / "in.parquet", {"id": ["a", "b"], "prompt": ["the cat", "a dog"], "doc": ["x", "y"]})
    job: dict[str, Any] = {
        "task": task,
        "model": {"path": str(model)},
        "input": {"path": str(inputs), "id_column": "id"},
        "output": {"path": str(tmp / "out")},
        **sections,
    }
    return write_job(tmp / "job.yaml", job)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args])
    return result.exit_code, result.output


def _max_pooling_folder(path: Path) -> Path:
    save_tiny_bert(path)
    write_sentence_transformers(path, "mean", normalize=False, hidden_size=64)
    config = json.loads((path / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_max_tokens=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("models")
    return {
        "llama": tiny_model_dir,  # 4 heads, 2 KV heads, hidden 64, no head
        "three_labels": save_llama_classifier(tmp / "three", build_tokenizer(), 3),
        "max_pooling": _max_pooling_folder(tmp / "st-max"),
    }


CASES = [  # (model, task, job sections, exit code, what the message says)
    (
        "three_labels",
        "score",
        {"pooling": {"score": "row"}},
        4,
        "task score needs a single-label head; this model's head has 3 labels",
    ),
    ("llama", "classify", {}, 4, "task classify needs a sequence-classification head"),
    ("llama", "score", {"pooling": {"score": "row"}}, 4, "pooling.score row needs a sequence-classification head"),
    ("llama", "embed", {"pooling": {"dimensions": 65}}, 2, "pooling.dimensions 65 exceeds the model's hidden size 64"),
    ("llama", "generate", {"engine": {"tensor_parallel_size": 3}}, 2, "4 attention heads are not divisible by 3"),
    ("llama", "embed", {"engine": {"tensor_parallel_size": 2}}, 2, "task embed runs on one device"),
    ("max_pooling", "embed", {}, 4, "pooling modes ['pooling_mode_max_tokens'] are not supported"),
]


@pytest.mark.parametrize(("model", "task", "sections", "code", "says"), CASES)
def test_validate_refuses_what_run_would_and_run_refuses_before_any_part(
    tmp_path: Path, models: dict[str, Path], model: str, task: str, sections: dict[str, Any], code: int, says: str
) -> None:
    job = _job(tmp_path, models[model], task, **sections)
    for command in ("validate", "run"):
        got, output = _cli(command, str(job))
        assert (got, says in output) == (code, True), (command, output)
    assert not list((tmp_path / "out").glob("part-*"))


def test_an_explicit_pooling_type_replaces_the_folders_pooling_module(tmp_path: Path, models: dict[str, Path]) -> None:
    pooling = {"pooling_type": "mean", "normalize": False}
    job = _job(tmp_path / "st", models["max_pooling"], "embed", pooling=pooling)
    assert _cli("validate", str(job))[0] == 0
    code, output = _cli("run", str(job), "--quiet")
    assert code == 0, output
    plain = save_tiny_bert(tmp_path / "plain")  # the same weights (seed 0) without sentence-transformers files
    code, output = _cli("run", str(_job(tmp_path / "plain-job", plain, "embed", pooling=pooling)), "--quiet")
    assert code == 0, output
    got, expected = (
        ds.dataset(p / "out").to_table().column("embedding").to_pylist()
        for p in (tmp_path / "st", tmp_path / "plain-job")
    )
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-6)
