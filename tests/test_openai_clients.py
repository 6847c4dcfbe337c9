"""The OpenAI batch output file as its clients read it: pooling jobs' bodies in vLLM's /classify
and /score shapes, and every chat, completions and embeddings line checked with the `openai`
package's own response types."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from testkit.pooling_models import save_tiny_bert
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


CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
HELLO = [{"role": "user", "content": "once upon a time"}]


def _requests(tmp: Path, lines: list[tuple[str, str, dict[str, Any]]]) -> Path:
    rows = [{"custom_id": c, "method": "POST", "url": url, "body": {"model": "m", **body}} for c, url, body in lines]
    (tmp / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return tmp / "r.jsonl"


def _client_types(lines: list[dict[str, Any]]) -> list[Any]:
    """Each served line's body as the `openai` package reads it (its own pydantic types)."""
    from openai.types import Completion, CreateEmbeddingResponse
    from openai.types.chat import ChatCompletion

    kinds = {"chat.completion": ChatCompletion, "text_completion": Completion, "list": CreateEmbeddingResponse}
    return [
        kinds[x["response"]["body"]["object"]].model_validate(x["response"]["body"]) for x in lines if not x["error"]
    ]


def test_an_openai_batch_file_asking_for_logprobs_runs_unchanged(tmp_path: Path, tiny_model_dir: Path) -> None:
    """No sampling.logprobs in the job: each request that asks gets its own k; others get none."""
    path = _requests(
        tmp_path,
        [
            ("chat3", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 4}),
            ("text2", COMPLETIONS, {"prompt": "the little cat", "logprobs": 2, "max_tokens": 4}),
            ("plain", CHAT, {"messages": HELLO, "max_tokens": 4}),
            ("chat0", CHAT, {"messages": HELLO, "logprobs": True, "max_tokens": 3}),
            ("many", COMPLETIONS, {"prompt": "the cat", "logprobs": 21}),
        ],
    )
    job = {
        "model": {"path": str(tiny_model_dir)},
        "input": {"path": str(path), "format": "openai_batch"},
        "output": {"path": str(tmp_path / "out"), "format": "openai_batch"},
        "engine": {"backend": "native"},
    }
    _, lines = _run(tmp_path, job)
    chat3, text2, plain, chat0 = _client_types(lines)
    assert [len(t.top_logprobs) for t in chat3.choices[0].logprobs.content] == [3] * 4
    assert chat3.choices[0].logprobs.content[0].logprob <= 0
    assert [len(t) for t in text2.choices[0].logprobs.top_logprobs] == [2] * 4
    assert len(text2.choices[0].logprobs.token_logprobs) == text2.usage.completion_tokens == 4
    assert plain.choices[0].logprobs is None
    assert [len(t.top_logprobs) for t in chat0.choices[0].logprobs.content] == [0] * 3
    many = lines[4]
    assert many["response"]["status_code"] == 400 and many["error"]["code"] == "invalid_request"
    assert "body.logprobs=21: at most 20 top logprobs" in many["error"]["message"]


def test_embeddings_lines_read_as_the_client_reads_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _requests(tmp_path, [("e1", EMBEDDINGS, {"input": "the little cat"}), ("e2", EMBEDDINGS, {"input": "x"})])
    job = {
        "task": "embed",
        "model": {"path": str(tiny_model_dir)},
        "input": {"path": str(path), "format": "openai_batch"},
        "output": {"path": str(tmp_path / "out"), "format": "openai_batch"},
    }
    rows, lines = _run(tmp_path, job)
    responses = _client_types(lines)
    assert len(responses) == 2
    for response, row in zip(responses, rows, strict=True):
        assert response.data[0].embedding == pytest.approx(row["embedding"], abs=1e-7)
        assert response.usage.prompt_tokens == row["input_tokens"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": "hi", "stream": True}, "body.stream=true is not supported: a batch answers each request whole"),
        ({"prompt": "hi", "n": 2}, "body.n=2 cannot be set per request (the job's sampling.n applies to every line)"),
    ],
)
def test_refused_request_fields_say_why_in_words(body: dict[str, Any], says: str) -> None:
    from batchgen.inputs.openai_requests import RequestProblem, request_row

    line = {"custom_id": "x", "method": "POST", "url": COMPLETIONS, "body": body}
    with pytest.raises(RequestProblem, match=re.escape(says)):
        request_row(json.dumps(line))


def test_finalize_of_a_finished_output_writes_a_deleted_output_file_again(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _pooling_job(tmp_path, tiny_model_dir, "embed")
    _run(tmp_path, job)
    output_file = tmp_path / "out" / "_batch_output.jsonl"
    original = output_file.read_bytes()
    output_file.unlink()
    result = CliRunner().invoke(main, ["finalize", str(tmp_path / "out")])
    assert result.exit_code == 0 and "already finalized" in result.output, result.output
    assert output_file.read_bytes() == original  # same ids, same created


def test_n_samples_with_per_line_logprobs_read_as_the_client_reads_them(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _requests(
        tmp_path,
        [
            ("chat", CHAT, {"messages": HELLO, "logprobs": True, "top_logprobs": 1, "max_tokens": 3}),
            ("text", COMPLETIONS, {"prompt": "the cat", "max_tokens": 3}),
        ],
    )
    job = {
        "model": {"path": str(tiny_model_dir)},
        "input": {"path": str(path), "format": "openai_batch"},
        "output": {"path": str(tmp_path / "out"), "format": "openai_batch"},
        "sampling": {"n": 2, "temperature": 1.0, "seed": 3},
        "engine": {"backend": "native"},
    }
    _, lines = _run(tmp_path, job)
    chat, text = _client_types(lines)
    assert [c.index for c in chat.choices] == [0, 1] and [c.index for c in text.choices] == [0, 1]
    for choice in chat.choices:
        assert [len(t.top_logprobs) for t in choice.logprobs.content] == [1] * len(choice.logprobs.content)
    assert all(c.logprobs is None for c in text.choices)
