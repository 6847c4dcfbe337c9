"""The OpenAI batch output file as its clients read it: pooling jobs' bodies in vLLM's /classify
and /score shapes, and every chat, completions and embeddings line checked with the `openai`
package's own response types."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.testing.pooling_models import save_tiny_bert
from tests.conftest import write_job, write_parquet

PROMPTS = ["the cat", "once upon a time", "", "a dog"]
DOCS = ["a dog", "the sun", "her friend", "the cat"]


def _run(tmp: Path, job: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the parts' rows, the output file's lines) of a finished job."""
    result = CliRunner().invoke(main, ["run", str(write_job(tmp / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    rows = ds.dataset(tmp / "out", format="parquet").to_table().to_pylist()
    lines = [json.loads(x) for x in (tmp / "out" / "_batch_output.jsonl").read_text().splitlines()]
    return rows, lines


def _pooling_job(tmp: Path, model: Path, task: str, **extra: Any) -> dict[str, Any]:
    inputs = write_parquet(tmp / "in.parquet", {"id": ["a", "b", "c", "d"], "prompt": PROMPTS, "doc": DOCS})
    return {
        "task": task,
        "model": {"path": str(model)},
        "input": {"path": str(inputs), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(tmp / "out"), "format": "openai_batch"},
        **extra,
    }


@pytest.mark.parametrize("task", ["classify", "score"])
def test_classify_and_score_jobs_write_vllm_pooling_bodies(tmp_path: Path, task: str) -> None:
    model = save_tiny_bert(tmp_path / "model", num_labels=3 if task == "classify" else 1)
    extra = {"pooling": {"score": "pair", "document_column": "doc"}} if task == "score" else {}
    rows, lines = _run(tmp_path, _pooling_job(tmp_path, model, task, **extra))
    assert [line["custom_id"] for line in lines] == ["a", "b", "c", "d"]
    for row, line in zip(rows, lines, strict=True):
        if row["error_code"] is not None:
            assert line["response"]["status_code"] == 400 and line["error"]["code"] == row["error_code"]
            continue
        body = line["response"]["body"]
        assert body["object"] == "list" and body["id"].startswith(f"{task}-") and body["model"] == "model"
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == row["input_tokens"] > 0
        (item,) = body["data"]
        if task == "classify":
            assert item["label"] == row["label"] and item["num_classes"] == 3
            assert item["probs"] == pytest.approx(row["probs"], abs=1e-7)
        else:
            assert item == {"index": 0, "object": "score", "score": row["score"]} and row["score"] is not None
    assert [line["error"] is None for line in lines] == [True, True, False, True]  # "" is an empty_prompt row
