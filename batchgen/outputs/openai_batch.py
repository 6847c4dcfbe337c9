"""`output.format: openai_batch`: the OpenAI Batch API output file, written from the committed parts
once the job is complete, so a pipeline built for the OpenAI Batch API (or `vllm run-batch`) reads
batchgen's results unchanged.

The parts stay the source of truth (crash-safe, resumable); this file is derived from them, one
JSON line per input row in input order, written atomically as `_batch_output.jsonl` in the output
folder (the leading "_" keeps Parquet readers of the folder off it). A rerun of a completed job
writes it again when it is missing. Each line: `id`, `custom_id`, `response` {status_code,
request_id, body} and `error`. A served row has status 200, a body shaped like the endpoint's
(chat.completion or text_completion, with `usage`; an embedding list; vLLM's /classify or /score
list for a classify or score job) and `error: null`; a failed row has status 400
(500 for an engine failure), `body.error`, and the same `error` {code, message} at the top level.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.inputs.openai_requests import CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL
from batchgen.job.spec import JobSpec
from batchgen.outputs.openai_logprobs import choice_logprobs
from batchgen.outputs.state import BATCH_OUTPUT_NAME
from batchgen.outputs.table import INPUT_ROW_COLUMN, ROW_ID_COLUMN
from batchgen.storage.base import Storage

OUTPUT_NAME = BATCH_OUTPUT_NAME
_RESULTS = [
    "generated_text",
    "finish_reason",
    "input_tokens",
    "cached_tokens",
    "output_tokens",
    "error_code",
    "error_message",
]
_OPTIONAL = [
    "url",
    "model",
    "reasoning_text",
    "reasoning_tokens",
    "logprobs",
    "logprobs_requested",
    "embedding",
    "label",
    "probs",
    "score",
]
# Why these two: no OpenAI endpoint classifies or scores; vLLM's server does, at these paths, and
# its response bodies are what a client of a pooling model reads (they name no request line's url).
CLASSIFY_URL = "/classify"
SCORE_URL = "/score"
_POOLED_URLS = {"embed": EMBEDDINGS_URL, "classify": CLASSIFY_URL, "score": SCORE_URL}


@dataclass(frozen=True)
class BatchFacts:
    """What the output file needs from the job, kept in the job record (`run.openai_batch`) so that
    a shard run or `batchgen finalize` that completes the job writes it without the job file."""

    id_column: str  # custom_id: the id column, or row_id
    default_url: str  # for rows without a url column (inputs that are not OpenAI batch files)
    model: str  # for rows that name no model
    fingerprint: str  # makes ids stable across reruns of the same job

    @classmethod
    def of(cls, spec: JobSpec, fingerprint: str) -> BatchFacts | None:
        if spec.output.format != "openai_batch":
            return None
        url = CHAT_URL if spec.input.messages_column is not None else COMPLETIONS_URL
        url = _POOLED_URLS.get(spec.task, url)
        return cls(spec.input.id_column or ROW_ID_COLUMN, url, Path(spec.model.path).name, fingerprint)

    def to_record(self) -> dict[str, str]:
        return dict(self.__dict__)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> BatchFacts | None:
        facts = record.get("run", {}).get("openai_batch")
        return cls(**facts) if isinstance(facts, dict) else None


def write_batch_output(
    storage: Storage, record: dict[str, Any], facts: BatchFacts | None = None, again: bool = False
) -> bool:
    """Write the output file from every committed part when the job asks for it (`facts`, else the
    record's); with `again`, only when it is missing. True when written. `created` in every body is
    the job's start (the record's), so a rewrite gives the same bytes."""
    facts = facts or BatchFacts.from_record(record)
    if facts is None or (again and storage.exists(OUTPUT_NAME)):
        return False
    created = int(record.get("run", {}).get("started", 0))
    names = list(storage.committed_parts().values())
    lines = _lines(storage, names, facts, created)
    if storage.local_dir is not None:
        from batchgen.storage.local import atomic_write

        atomic_write(storage.local_dir / OUTPUT_NAME, lambda tmp: _write_lines(tmp, lines), "batch_output_temp_write")
    else:  # an object store: one put of the whole file (no partial object is ever visible)
        buffer = io.StringIO()
        buffer.writelines(lines)
        storage.write_text(OUTPUT_NAME, buffer.getvalue(), "batch_output_temp_write")
    return True


def _write_lines(tmp: Path, lines: Iterator[str]) -> None:
    with tmp.open("w", encoding="utf-8") as fh:
        fh.writelines(lines)


def _lines(storage: Storage, names: list[str], facts: BatchFacts, created: int) -> Iterator[str]:
    schemas = [storage.dataset([name]).schema for name in names]
    if names and INPUT_ROW_COLUMN in schemas[0].names:
        # Why sorted: parts follow the prefix plan, the file follows the input. An OpenAI batch
        # file holds at most 50,000 requests, so its results are sorted in memory.
        tables = [_results(storage, name, schema, facts, [INPUT_ROW_COLUMN]) for name, schema in zip(names, schemas)]
        table = pa.concat_tables(tables, promote_options="permissive").sort_by(INPUT_ROW_COLUMN)
        rows = table.column(INPUT_ROW_COLUMN).to_pylist()
        for row, values in zip(rows, table.drop_columns([INPUT_ROW_COLUMN]).to_pylist()):
            yield json.dumps(batch_line(values, facts, row, created), ensure_ascii=False) + "\n"
        return
    row = 0  # an output made before input_row: its parts are in input order
    for name, schema in zip(names, schemas):
        for values in _results(storage, name, schema, facts).to_pylist():
            yield json.dumps(batch_line(values, facts, row, created), ensure_ascii=False) + "\n"
            row += 1


def _results(
    storage: Storage, name: str, schema: pa.Schema, facts: BatchFacts, extra: list[str] | None = None
) -> pa.Table:
    """One part's columns that the output lines are made of (and `extra`)."""
    columns = [*(extra or []), facts.id_column, *_RESULTS, *(c for c in _OPTIONAL if c in schema.names)]
    table: pa.Table = storage.read_table(name, list(dict.fromkeys(columns)))
    return table


def batch_line(values: dict[str, Any], facts: BatchFacts, row: int, created: int) -> dict[str, Any]:
    """One output line of one output row (its values by column name)."""
    key = hashlib.sha256(f"{facts.fingerprint}:{row}".encode()).hexdigest()[:24]
    custom_id = values.get(facts.id_column)
    line: dict[str, Any] = {"id": f"batch_req_{key}", "custom_id": None if custom_id is None else str(custom_id)}
    code = values["error_code"]
    if code is not None:
        status = 500 if code == "engine_error" else 400
        kind = "server_error" if status == 500 else "invalid_request_error"
        error = {"message": values["error_message"], "type": kind, "param": None, "code": code}
        line["response"] = {"status_code": status, "request_id": f"req_{key}", "body": {"error": error}}
        line["error"] = {"code": code, "message": values["error_message"]}
        return line
    line["response"] = {"status_code": 200, "request_id": f"req_{key}", "body": _body(values, facts, key, created)}
    line["error"] = None
    return line


def _sample_logprobs(values: dict[str, Any], n: int, chat: bool) -> list[dict[str, Any] | None]:
    """Each sample's choice logprobs when the request asked for them (and the job computed them)."""
    asked, entries = values.get("logprobs_requested"), values.get("logprobs")
    if asked is None or entries is None:
        return [None] * n
    per_sample = entries if n > 1 else [entries]
    return [choice_logprobs(e, asked, chat) for e in per_sample]


def _body(values: dict[str, Any], facts: BatchFacts, key: str, created: int) -> dict[str, Any]:
    url = values.get("url") or facts.default_url
    if url == EMBEDDINGS_URL:
        return _embedding_body(values, facts)
    if url in (CLASSIFY_URL, SCORE_URL):
        return _pooled_body(values, facts, url, key, created)
    chat = url == CHAT_URL
    texts, reasons = values["generated_text"], values["finish_reason"]
    reasoning = values.get("reasoning_text")
    many = isinstance(texts, list)
    texts, reasons = (texts, reasons) if many else ([texts], [reasons])
    reasoning = reasoning if isinstance(reasoning, list) else [reasoning] * len(texts)
    logprobs = _sample_logprobs(values, len(texts), chat)
    choices = []
    for k, (text, reason) in enumerate(zip(texts, reasons)):
        thought = {"reasoning_content": reasoning[k]} if "reasoning_text" in values else {}
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": text, **thought}
            choices.append({"index": k, "message": message, "logprobs": logprobs[k], "finish_reason": reason})
        else:  # why the choice carries it: a completion has no message, and the answer alone may be ""
            choices.append({"index": k, "text": text, **thought, "logprobs": logprobs[k], "finish_reason": reason})
    usage: dict[str, Any] = {
        "prompt_tokens": values["input_tokens"],
        "completion_tokens": values["output_tokens"],
        "total_tokens": values["input_tokens"] + values["output_tokens"],
        "prompt_tokens_details": {"cached_tokens": values["cached_tokens"]},
    }
    if "reasoning_tokens" in values:
        usage["completion_tokens_details"] = {"reasoning_tokens": values["reasoning_tokens"]}
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{key}",
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": values.get("model") or facts.model,
        "choices": choices,
        "usage": usage,
    }


def _embedding_body(values: dict[str, Any], facts: BatchFacts) -> dict[str, Any]:
    """An embeddings response: one input, so one `data` item (floats); usage counts input tokens."""
    vector = values.get("embedding")
    embedding = None if vector is None else [float(x) for x in vector]
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
        "model": values.get("model") or facts.model,
        "usage": {"prompt_tokens": values["input_tokens"], "total_tokens": values["input_tokens"]},
    }


def _pooled_body(values: dict[str, Any], facts: BatchFacts, url: str, key: str, created: int) -> dict[str, Any]:
    """vLLM's /classify (label, probs, num_classes) or /score (score) response of one input."""
    if url == CLASSIFY_URL:
        probs = [float(p) for p in values.get("probs") or []]
        item: dict[str, Any] = {"index": 0, "label": values.get("label"), "probs": probs, "num_classes": len(probs)}
    else:
        item = {"index": 0, "object": "score", "score": values.get("score")}
    tokens = values["input_tokens"]
    return {
        "id": f"{url.strip('/')}-{key}",
        "object": "list",
        "created": created,
        "model": values.get("model") or facts.model,
        "data": [item],
        "usage": {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": values["cached_tokens"]},
        },
    }
