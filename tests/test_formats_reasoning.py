"""`output.reasoning: auto`: a reasoning model's thinking split into `reasoning_text` with its own
`reasoning_tokens`, counted on token ids. A tiny tokenizer with `<think>` / `</think>` as added
tokens (plain ones, and special ones the detokenizer skips) and a tiny model built on it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.outputs.reasoning import ReasoningSplitter, Split
from tests.conftest import (
    CHAT_TEMPLATE,
    build_tokenizer,
    make_job,
    output_table,
    save_tiny_llama,
    write_job,
    write_parquet,
)

OPENS_THINKING = CHAT_TEMPLATE.replace("<|assistant|>{% endif %}", "<|assistant|><think>{% endif %}")


def _thinking_tokenizer(special: bool = False) -> Any:
    tok = build_tokenizer()
    if special:
        tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    else:
        tok.add_tokens(["<think>", "</think>"])
    return tok


def _ids(tok: Any, *pieces: str) -> list[int]:
    return [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]


@pytest.mark.parametrize("special", [False, True])
def test_split_on_token_ids(special: bool) -> None:
    tok = _thinking_tokenizer(special)
    splitter = ReasoningSplitter.of(tok)
    assert splitter is not None
    start, end = splitter.start_id, splitter.end_id

    def split(ids: list[int], prompt: list[int] | None = None) -> Split:
        text = tok.decode(ids, skip_special_tokens=True)  # what the engine's detokenizer gives
        return splitter.split(ids, text, prompt or _ids(tok, "once"))

    ids = [start, *_ids(tok, "the little cat"), end, *_ids(tok, "\n\nthe dog")]
    assert split(ids) == Split("the little cat", "the dog", 1 + len(_ids(tok, "the little cat")) + 1)
    unterminated = [start, *_ids(tok, "a cat who")]  # hit max_tokens while thinking: all reasoning
    assert split(unterminated) == Split("a cat who", "", len(unterminated))
    opened = _ids(tok, "a cat who")  # the prompt (chat template) ends inside <think>
    assert split(opened, [*_ids(tok, "once"), start]) == Split("a cat who", "", len(opened))
    assert split(opened, [start, end]) == Split(None, "a cat who", 0)  # a closed block in the prompt opens nothing
    plain = _ids(tok, "the dog")
    assert split(plain) == Split(None, "the dog", 0)


def test_a_tokenizer_without_markers_has_no_splitter() -> None:
    assert ReasoningSplitter.of(build_tokenizer()) is None


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = _thinking_tokenizer()
    tok.chat_template = OPENS_THINKING
    return save_tiny_llama(tmp_path_factory.mktemp("thinking"), tok)


def _run(tmp: Path, model: Path, reasoning: str, bias: float, name: str) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    end_id = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("</think>")
    messages = [[{"role": "user", "content": text}] for text in ("once upon a time", "the little cat", "her friend")]
    write_parquet(tmp / "in.parquet", {"id": ["a", "b", "c"], "messages": messages})
    sampling = {"max_tokens": 4, "logit_bias": {end_id: bias}}
    job = make_job(model, str(tmp / "in.parquet"), tmp / name, engine={"backend": "native"}, sampling=sampling)
    job["input"] = {"path": str(tmp / "in.parquet"), "messages_column": "messages", "id_column": "id"}
    job["output"]["reasoning"] = reasoning
    job["output"]["format"] = "openai_batch"
    result = CliRunner().invoke(main, ["run", str(write_job(tmp / f"{name}.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return output_table(tmp / name).to_pylist()


def test_unterminated_thinking_is_all_reasoning(tmp_path: Path, thinking_model: Path) -> None:
    plain = _run(tmp_path, thinking_model, "none", -100.0, "plain")  # </think> never sampled
    split = _run(tmp_path, thinking_model, "auto", -100.0, "split")
    assert "reasoning_text" not in plain[0]
    for before, after in zip(plain, split):
        assert after["generated_text"] == "" and after["reasoning_text"] == before["generated_text"].strip()
        assert after["reasoning_tokens"] == after["output_tokens"] == before["output_tokens"] == 4
    manifest = json.loads((tmp_path / "split" / "_SUCCESS").read_text())
    assert (
        manifest["tokens"]["reasoning"] == 12
        and "reasoning" not in json.loads((tmp_path / "plain" / "_SUCCESS").read_text())["tokens"]
    )
    report = CliRunner().invoke(main, ["report", str(tmp_path / "split"), "--json"])
    assert report.exit_code == 0, report.output
    assert json.loads(report.output)["totals"]["reasoning_tokens"] == 12
    table = CliRunner().invoke(main, ["report", str(tmp_path / "split")])
    header = next(line for line in table.output.splitlines() if line.startswith("group"))
    assert header.split()[4:8] == ["input", "cached", "output", "reasoning"]


def test_the_end_marker_ends_the_reasoning_and_counts_in_it(tmp_path: Path, thinking_model: Path) -> None:
    plain = _run(tmp_path, thinking_model, "none", 100.0, "plain")  # every sampled token is </think>
    split = _run(tmp_path, thinking_model, "auto", 100.0, "split")
    for before, after in zip(plain, split):
        assert before["generated_text"] == "</think>" * 4
        assert after["reasoning_text"] == "" and after["reasoning_tokens"] == 1
        assert after["generated_text"] == "</think>" * 3
    lines = [json.loads(x) for x in (tmp_path / "split" / "_batch_output.jsonl").read_text().splitlines()]
    for line, row in zip(lines, split):  # chat lines carry the reasoning as vLLM's server does
        body = line["response"]["body"]
        assert body["choices"][0]["message"] == {
            "role": "assistant",
            "content": "</think>" * 3,
            "reasoning_content": "",
        }
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 1}
        assert body["usage"]["completion_tokens"] == row["output_tokens"] == 4


def test_completions_lines_keep_the_reasoning(tmp_path: Path, thinking_model: Path) -> None:
    """A prompt (a /v1/completions line) that opens a thinking block: the answer is empty, and the
    output line's choice still carries the thinking, as a chat line's message does."""
    write_parquet(tmp_path / "in.parquet", {"id": ["a", "b"], "prompt": ["once upon a time<think>", "the cat<think>"]})
    job = make_job(thinking_model, str(tmp_path / "in.parquet"), tmp_path / "out", sampling={"max_tokens": 4})
    job["output"].update({"reasoning": "auto", "format": "openai_batch"})
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output
    rows = output_table(tmp_path / "out").to_pylist()
    lines = [json.loads(x) for x in (tmp_path / "out" / "_batch_output.jsonl").read_text().splitlines()]
    for line, row in zip(lines, rows, strict=True):
        body = line["response"]["body"]
        assert body["object"] == "text_completion" and row["reasoning_text"]
        assert body["choices"][0]["text"] == row["generated_text"] == ""
        assert body["choices"][0]["reasoning_content"] == row["reasoning_text"]
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
