"""OpenAI Batch API compatibility end to end: a file of OpenAI batch requests (chat and completions,
with body sampling fields, and bad lines of every kind) runs as a job, and `output.format:
openai_batch` writes the OpenAI batch output file, checked field by field against the parts and
against the same prompts run as a plain Parquet job. Bad lines become error lines, never a crash."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import make_job, output_table, write_job, write_parquet

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _line(custom_id: str | None, url: str, body: dict[str, Any]) -> dict[str, Any]:
    line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    return line if custom_id is not None else {k: v for k, v in line.items() if k != "custom_id"}


SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", "big"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
TEXT_PARTS = [{"type": "text", "text": "the little "}, {"type": "text", "text": "cat"}]
LINES: list[tuple[Any, str | None]] = [  # (line, the error code it must give; None: served)
    (_line("c1", CHAT, {"model": "gpt-x", "messages": [{"role": "user", "content": "once upon a time"}]}), None),
    ("this is not json", "invalid_json"),
    (_line("p1", COMPLETIONS, {"model": "m", "prompt": "the little cat", "max_tokens": 5}), None),
    (_line(None, COMPLETIONS, {"prompt": "no id"}), "invalid_request"),
    (_line("u1", "/v1/images/generations", {"prompt": "x"}), "unsupported_url"),
    (_line("b1", CHAT, {"messages": "hi"}), "invalid_request"),
    (_line("t1", CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": []}), "unsupported_parameter"),
    (_line("n1", COMPLETIONS, {"prompt": "hi", "n": 2}), "unsupported_parameter"),
    (_line("e1", "/v1/embeddings", {"model": "m", "input": "hello"}), "unsupported_url"),
    (_line("c2", CHAT, {"messages": [{"role": "user", "content": TEXT_PARTS}], "max_completion_tokens": 5}), None),
    (_line("p2", COMPLETIONS, {"prompt": "her friend", "max_tokens": 2, "temperature": 0.0, "stop": "zzz"}), None),
    (
        _line(
            "j1",
            COMPLETIONS,
            {"prompt": "the cat", "max_tokens": 40, "temperature": 1.0, "seed": 5, "response_format": RF},
        ),
        None,
    ),
    (_line("j2", COMPLETIONS, {"prompt": "the cat", "response_format": {"type": "json_schema"}}), "invalid_request"),
    (
        _line("l1", CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}),
        "invalid_request",
    ),
    (_line("c1", COMPLETIONS, {"prompt": "again"}), "duplicate_id"),
]


def _write_requests(path: Path) -> Path:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line, _ in LINES)
    path.write_text(text, encoding="utf-8")
    return path


def _job(model: Path, inputs: str, out: Path, **input_keys: Any) -> dict[str, Any]:
    job = make_job(model, inputs, out, engine={"backend": "native", "window_rows": 4}, sampling={"max_tokens": 5})
    job["input"] = {"path": inputs, **input_keys}
    job["output"]["format"] = "openai_batch"
    return job


def _run(tmp: Path, job: dict[str, Any]) -> None:
    result = CliRunner().invoke(main, ["run", str(write_job(tmp / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)


def _output_lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "_batch_output.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("openai")
    _run(tmp, _job(tiny_model_dir, str(_write_requests(tmp / "requests.jsonl")), tmp / "out", format="openai_batch"))
    return tmp / "out"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, str]:
    """The same prompts as plain Parquet jobs (a prompt column; a messages column): custom_id -> text."""
    tmp = tmp_path_factory.mktemp("reference")
    write_parquet(tmp / "p.parquet", {"id": ["p1"], "prompt": ["the little cat"]})
    messages = [[{"role": "user", "content": "once upon a time"}], [{"role": "user", "content": "the little cat"}]]
    write_parquet(tmp / "m.parquet", {"id": ["c1", "c2"], "messages": messages})
    texts: dict[str, str] = {}
    for name, keys in (("p", {"prompt_column": "prompt"}), ("m", {"messages_column": "messages"})):
        _run(tmp, _job(tiny_model_dir, str(tmp / f"{name}.parquet"), tmp / name, id_column="id", **keys))
        table = output_table(tmp / name)
        texts.update(zip(table.column("id").to_pylist(), table.column("generated_text").to_pylist()))
        for line in _output_lines(tmp / name):  # a Parquet input's output file: custom_id is the id column
            assert line["response"]["body"]["object"] == ("chat.completion" if name == "m" else "text_completion")
    return texts


def test_every_request_gets_a_line_in_input_order(batch_run: Path) -> None:
    lines = _output_lines(batch_run)
    assert len(lines) == len(LINES)
    expected_ids = [None if isinstance(line, str) else line.get("custom_id") for line, _ in LINES]
    assert [line["custom_id"] for line in lines] == expected_ids
    codes = [None if line["error"] is None else line["error"]["code"] for line in lines]
    assert codes == [code for _, code in LINES]
    assert len({line["id"] for line in lines}) == len(lines)  # ids unique


def test_served_lines_have_the_openai_shape_and_the_parts_usage(
    batch_run: Path, reference: dict[str, str], tiny_model_dir: Path
) -> None:
    parts = output_table(batch_run).to_pylist()
    for line, row in zip(_output_lines(batch_run), parts):
        if line["error"] is not None:
            continue
        assert set(line) == {"id", "custom_id", "response", "error"} and line["id"].startswith("batch_req_")
        response = line["response"]
        assert set(response) == {"status_code", "request_id", "body"} and response["status_code"] == 200
        body = response["body"]
        assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
        assert isinstance(body["created"], int) and body["created"] > 0
        (choice,) = body["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] == row["finish_reason"]
        if row["url"] == CHAT:
            assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
            assert set(choice) == {"index", "message", "logprobs", "finish_reason"}
            assert choice["message"] == {"role": "assistant", "content": row["generated_text"]}
        else:
            assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
            assert (
                set(choice) == {"index", "text", "logprobs", "finish_reason"}
                and choice["text"] == row["generated_text"]
            )
        assert body["model"] == (row["model"] or tiny_model_dir.name)  # the body's model, else the model folder's name
        usage = body["usage"]
        assert usage == {
            "prompt_tokens": row["input_tokens"],
            "completion_tokens": row["output_tokens"],
            "total_tokens": row["input_tokens"] + row["output_tokens"],
            "prompt_tokens_details": {"cached_tokens": row["cached_tokens"]},
        }
        assert row["input_tokens"] > 0 and row["output_tokens"] > 0
        if line["custom_id"] in reference:  # the same prompt as a plain job: the same text
            assert row["generated_text"] == reference[line["custom_id"]], line["custom_id"]
    by_id = {line["custom_id"]: line for line in reversed(_output_lines(batch_run))}  # first use of an id wins
    assert by_id["p2"]["response"]["body"]["usage"]["completion_tokens"] <= 2  # body.max_tokens per request
    assert by_id["c1"]["response"]["body"]["model"] == "gpt-x"
    structured = by_id["j1"]["response"]["body"]["choices"][0]  # body.response_format: structured output
    jsonschema.validate(json.loads(structured["text"]), SCHEMA)
    assert structured["finish_reason"] == "stop"


def test_bad_lines_are_error_lines_naming_the_line(batch_run: Path) -> None:
    lines = _output_lines(batch_run)
    for number, (line, (_, code)) in enumerate(zip(lines, LINES), start=1):
        if code is None:
            continue
        response = line["response"]
        assert response["status_code"] == 400 and set(response) == {"status_code", "request_id", "body"}
        error = response["body"]["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error"
        assert line["error"] == {"code": code, "message": error["message"]}
        assert "requests.jsonl" in error["message"]
        assert f"(line {number})" in error["message"], error["message"]  # every row's message names its line
    messages = {line["custom_id"]: line["error"]["message"] for line in lines if line["error"]}
    assert "needs task: embed" in messages["e1"] and "body.tools is not supported" in messages["t1"]
    assert "duplicate id 'c1': first used by" in lines[-1]["error"]["message"]


def test_a_rerun_of_the_completed_job_writes_a_missing_file_again(tmp_path: Path, batch_run: Path) -> None:
    original = (batch_run / "_batch_output.jsonl").read_bytes()
    (batch_run / "_batch_output.jsonl").unlink()
    result = CliRunner().invoke(main, ["run", str(batch_run.parent / "job.yaml"), "--quiet"])
    assert result.exit_code == 0 and "already finished" in result.output
    assert (batch_run / "_batch_output.jsonl").read_bytes() == original  # same ids, same created


def test_an_openai_batch_file_read_as_plain_jsonl_says_which_format_reads_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    job = make_job(tiny_model_dir, str(_write_requests(tmp_path / "r.jsonl")), tmp_path / "out")
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 3 and "a file of OpenAI batch requests; set input.format: openai_batch" in result.output
    assert not (tmp_path / "out").exists()


def test_an_openai_batch_job_may_not_name_its_own_columns(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tiny_model_dir, str(_write_requests(tmp_path / "r.jsonl")), tmp_path / "out", format="openai_batch")
    job["input"]["prompt_column"] = "text"
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 2 and "openai_batch sets prompt_column" in result.output
    assert not (tmp_path / "out").exists()


def test_the_parts_stay_a_plain_batchgen_output(batch_run: Path) -> None:
    table = output_table(batch_run)
    assert table.column("custom_id").to_pylist()[:3] == ["c1", None, "p1"]
    part = pa.struct([("type", pa.string()), ("text", pa.string()), ("image_url", pa.string())])  # (images)
    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("parts", pa.list_(part))])
    assert table.schema.field("messages").type == pa.list_(message)
    manifest = json.loads((batch_run / "_SUCCESS").read_text())
    assert manifest["rows"] == {"total": len(LINES), "ok": 5, "error": len(LINES) - 5}


def test_the_output_file_on_an_object_store(tmp_path: Path, tiny_model_dir: Path, batch_run: Path) -> None:
    from tests.s3_server import moto_s3, options

    with moto_s3() as s3:
        job = _job(tiny_model_dir, str(_write_requests(tmp_path / "r.jsonl")), tmp_path / "x", format="openai_batch")
        job["output"] = {"path": "s3://outputs/batch", "storage_options": options(s3), "format": "openai_batch"}
        _run(tmp_path, job)
        with s3["fs"].open_input_stream("outputs/batch/_batch_output.jsonl") as fh:
            lines = [json.loads(x) for x in fh.read().decode().splitlines()]
        s3["fs"].delete_file("outputs/batch/_batch_output.jsonl")  # a rerun of the completed job puts it back
        _run(tmp_path, job)
        with s3["fs"].open_input_stream("outputs/batch/_batch_output.jsonl") as fh:
            again = [json.loads(x) for x in fh.read().decode().splitlines()]
    local = _output_lines(batch_run)
    assert again == lines and len(lines) == len(local)
    for remote_line, local_line in zip(lines, local):
        assert remote_line["custom_id"] == local_line["custom_id"]
        assert (remote_line["error"] or {}).get("code") == (local_line["error"] or {}).get("code")  # (paths differ)
        body, reference = remote_line["response"]["body"], local_line["response"]["body"]
        assert body.get("choices") == reference.get("choices") and body.get("usage") == reference.get("usage")


def test_without_xgrammar_a_response_format_is_an_error_line(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # `import xgrammar` fails, as without the structured extra
    lines = [
        _line("j1", COMPLETIONS, {"prompt": "the cat", "response_format": RF}),
        _line("p1", COMPLETIONS, {"prompt": "the cat", "response_format": {"type": "text"}}),
    ]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    _run(tmp_path, _job(tiny_model_dir, str(tmp_path / "r.jsonl"), tmp_path / "out", format="openai_batch"))
    j1, p1 = _output_lines(tmp_path / "out")
    assert j1["error"]["code"] == "invalid_structured" and "batchgen[structured]" in j1["error"]["message"]
    assert p1["error"] is None and p1["response"]["status_code"] == 200


def test_logprobs_in_the_endpoints_shapes(tmp_path: Path, tiny_model_dir: Path) -> None:
    hello = [{"role": "user", "content": "once upon a time"}]
    lines = [
        _line("chat", CHAT, {"messages": hello, "logprobs": True, "top_logprobs": 2}),
        _line("text", COMPLETIONS, {"prompt": "the little cat", "logprobs": 1}),
        _line("none", CHAT, {"messages": hello}),
        _line("more", CHAT, {"messages": hello, "logprobs": True, "top_logprobs": 5}),
        _line("mixed", COMPLETIONS, {"prompt": "the cat", "top_logprobs": 1}),
    ]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    job = _job(tiny_model_dir, str(tmp_path / "r.jsonl"), tmp_path / "out", format="openai_batch")
    job["sampling"]["logprobs"] = 2  # the job computes the top 2 for every row; a request asking more gets its own k
    _run(tmp_path, job)
    chat, text, none, more, mixed = _output_lines(tmp_path / "out")
    parts = output_table(tmp_path / "out", ["logprobs"]).column("logprobs").to_pylist()
    content = chat["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["response"]["body"]["usage"]["completion_tokens"] == len(parts[0])
    for token, stored in zip(content, parts[0]):
        assert (token["token"], token["logprob"]) == (stored["token"], stored["logprob"])
        assert token["bytes"] == list(stored["token"].encode("utf-8"))
        assert [t["logprob"] for t in token["top_logprobs"]] == [t["logprob"] for t in stored["top"][:2]]
    completion = text["response"]["body"]["choices"][0]["logprobs"]
    assert completion["token_logprobs"] == [e["logprob"] for e in parts[1]]
    assert [len(top) for top in completion["top_logprobs"]] == [1] * len(parts[1])
    assert completion["text_offset"][0] == 0 and completion["text_offset"] == sorted(completion["text_offset"])
    assert none["response"]["body"]["choices"][0]["logprobs"] is None
    more_content = more["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert more["error"] is None and [len(t["top_logprobs"]) for t in more_content] == [5] * len(more_content)
    assert mixed["error"]["code"] == "invalid_request"


def test_embeddings_requests_in_an_embed_job(tmp_path: Path, tiny_model_dir: Path) -> None:
    import numpy as np

    from batchgen import LLM

    embed = "/v1/embeddings"
    lines = [
        _line("e1", embed, {"model": "emb", "input": "the little cat"}),
        _line("e2", embed, {"input": ["once upon a time"], "encoding_format": "float"}),
        _line("dim", embed, {"input": "the cat", "dimensions": 8}),
        _line("b64", embed, {"input": "the cat", "encoding_format": "base64"}),
        _line("chat", CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
    ]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    job = {
        "task": "embed",
        "model": {"path": str(tiny_model_dir)},
        "input": {"path": str(tmp_path / "r.jsonl"), "format": "openai_batch"},
        "output": {"path": str(tmp_path / "out"), "format": "openai_batch"},
    }
    _run(tmp_path, job)
    e1, e2, dim, b64, chat = _output_lines(tmp_path / "out")
    expected = LLM(str(tiny_model_dir), task="embed").embed(["the little cat", "once upon a time"])
    for line, reference in zip((e1, e2), expected):
        body = line["response"]["body"]
        assert line["error"] is None and body["object"] == "list" and set(body) == {"object", "data", "model", "usage"}
        (item,) = body["data"]
        assert item["object"] == "embedding" and item["index"] == 0
        np.testing.assert_allclose(item["embedding"], reference.outputs.embedding, rtol=1e-5, atol=1e-6)
        tokens = len(reference.prompt_token_ids)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert e1["response"]["body"]["model"] == "emb" and e2["response"]["body"]["model"] == tiny_model_dir.name
    assert dim["error"]["code"] == "unsupported_parameter" and "pooling.dimensions is null" in dim["error"]["message"]
    assert b64["error"]["code"] == "unsupported_parameter"
    assert chat["error"]["code"] == "unsupported_url" and "needs task: generate" in chat["error"]["message"]
