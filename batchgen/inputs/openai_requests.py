"""OpenAI Batch API request lines as input rows, so a file made for the OpenAI Batch API (or for
`vllm run-batch`) runs unchanged as a batchgen job.

Each line `{"custom_id", "method": "POST", "url", "body"}` becomes one row of fixed columns:
`custom_id` (the job's id column), `url`, `model`, `prompt` (completions) or `messages` (chat), and
the body's sampling fields as per-row sampling columns. A line that cannot be served (not JSON, no
custom_id, an unknown url, a body field batchgen cannot honour per request) becomes an error row
naming the line and the field: never a crashed job.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
EMBEDDINGS_URL = "/v1/embeddings"
URLS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL)

# body field -> the row's sampling column (input.sampling_columns maps SamplingParams fields to these)
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
}
SAMPLING_COLUMNS = {name: name for name in dict.fromkeys(SAMPLING_FIELDS.values())}
# Body fields that change nothing batchgen computes (the model is the job's; nothing streams).
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# Body fields with a neutral value that is the only one batchgen serves per request.
_NEUTRAL = {"stream": (False, None), "n": (1, None)}

# A message's content: text, or (when it holds images) its OpenAI content parts, each a text part or
# an image_url part whose url is kept as text (read for a vision-language model: inputs/content_parts).
PART = pa.struct([("type", pa.string()), ("text", pa.string()), ("image_url", pa.string())])
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("parts", pa.list_(PART))])
SCHEMA = pa.schema(
    [
        ("custom_id", pa.string()),
        ("url", pa.string()),
        ("model", pa.string()),
        ("prompt", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("max_tokens", pa.int64()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("seed", pa.int64()),
        ("presence_penalty", pa.float64()),
        ("frequency_penalty", pa.float64()),
        ("stop", pa.list_(pa.string())),
        ("json_schema", pa.string()),  # body.response_format: a JSON schema's text (structured output)
        ("logprobs_requested", pa.int64()),  # top logprobs the request asks for (0: the token's own); null: none
        ("dimensions", pa.int64()),  # an embeddings request's dimensions (the job's pooling.dimensions must match)
    ]
)


class RequestProblem(Exception):
    """Why one request line cannot be served; `code` becomes the row's error_code."""

    def __init__(self, code: str, message: str, custom_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.custom_id = custom_id


def request_row(text: str) -> dict[str, Any]:
    """The row of one request line; raises RequestProblem (carrying the custom_id when known)."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestProblem("invalid_json", f"not valid JSON: {exc}") from None
    if not isinstance(line, dict):
        raise RequestProblem("invalid_request", f"a request must be a JSON object, got {type(line).__name__}")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RequestProblem("invalid_request", "custom_id must be a non-empty string")
    try:
        return _request(line, custom_id)
    except RequestProblem as exc:
        exc.custom_id = custom_id
        raise


def _request(line: dict[str, Any], custom_id: str) -> dict[str, Any]:
    unknown = sorted(set(line) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise RequestProblem(
            "invalid_request", f"unknown key(s) {unknown} (a request has custom_id, method, url, body)"
        )
    if line.get("method", "POST") != "POST":
        raise RequestProblem("invalid_request", f"method must be POST, got {line.get('method')!r}")
    url, body = line.get("url"), line.get("body")
    if url not in URLS:
        raise RequestProblem("unsupported_url", f"url must be one of {', '.join(URLS)}, got {url!r}")
    if not isinstance(body, dict):
        raise RequestProblem("invalid_request", "body must be a JSON object")
    row: dict[str, Any] = {"custom_id": custom_id, "url": url, "model": _text_or_none(body.get("model"))}
    if url == EMBEDDINGS_URL:
        return _embedding_row(row, body)
    if url == CHAT_URL:
        row["messages"] = _messages(body.get("messages"))
        rest = set(body) - {"messages"}
    else:
        row["prompt"] = _prompt(body.get("prompt"))
        rest = set(body) - {"prompt"}
    row.update(_sampling(body, rest))
    return row


def _embedding_row(row: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """An embeddings request: its `input` (one text) is the row's prompt. Which task serves it is the
    job's (prepare.py: an embed job serves these rows, a generating job the others)."""
    text = body.get("input")
    if isinstance(text, list) and len(text) == 1:
        text = text[0]
    if not isinstance(text, str):
        raise RequestProblem(
            "invalid_request", "body.input must be one string (lists of texts or token ids: one line each)"
        )
    row["prompt"] = text
    for name in sorted(set(body) - {"input", "model", "user", "encoding_format", "dimensions"}):
        raise RequestProblem("unsupported_parameter", f"body.{name} is not supported for {EMBEDDINGS_URL}")
    if body.get("encoding_format", "float") not in ("float", None):
        raise RequestProblem("unsupported_parameter", "body.encoding_format: only float is supported")
    dimensions = body.get("dimensions")
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)):
        raise RequestProblem("invalid_request", "body.dimensions must be an integer")
    row["dimensions"] = dimensions
    return row


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if not isinstance(value, str):
        raise RequestProblem(
            "invalid_request", "body.prompt must be one string (lists of prompts or token ids: one line each)"
        )
    return value


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestProblem("invalid_request", "body.messages must be a non-empty list")
    out = []
    for j, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestProblem("invalid_request", f"body.messages[{j}] must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "image_url" for p in content):
            out.append({"role": message["role"], "content": None, "parts": _parts(content, j)})
        else:
            out.append({"role": message["role"], "content": _content(content, j)})
    return out


def _content(value: Any, j: int) -> str:
    """A message's text: a string, or a list of text parts (joined); other parts are refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        return "".join(str(p.get("text", "")) for p in value)
    raise RequestProblem("invalid_request", f"body.messages[{j}].content must be text, or text and image_url parts")


def _parts(value: list[Any], j: int) -> list[dict[str, Any]]:
    """Content parts with images: text parts and image_url parts (the url: a data URL, a path or an
    object-store URI; `detail` is a hint batchgen's processors do not take)."""
    parts = []
    for p, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        image = part.get("image_url") if kind == "image_url" else None
        url = image.get("url") if isinstance(image, dict) else image
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"], "image_url": None})
        elif kind == "image_url" and isinstance(url, str) and url:
            parts.append({"type": "image_url", "text": None, "image_url": url})
        else:
            why = "a text part with a string text, or an image_url part with a url"
            raise RequestProblem("invalid_request", f"body.messages[{j}].content[{p}] must be {why}")
    return parts


def _sampling(body: dict[str, Any], fields: set[str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for name in sorted(fields):
        value = body[name]
        if name in _IGNORED:
            continue
        if name in _NEUTRAL:
            if value not in _NEUTRAL[name]:
                why = (
                    "cannot be set per request (the job's sampling.n applies to every line)"
                    if name == "n"
                    else "is not supported: a batch answers each request whole (nothing streams)"
                )
                raise RequestProblem("unsupported_parameter", f"body.{name}={json.dumps(value)} {why}")
            continue
        if name in ("logprobs", "top_logprobs"):
            continue  # (read together below)
        if name == "response_format":
            schema = _response_format(value)
            if schema is not None:
                values["json_schema"] = schema
            continue
        if name not in SAMPLING_FIELDS:
            raise RequestProblem("unsupported_parameter", f"body.{name} is not supported")
        values[SAMPLING_FIELDS[name]] = _sampling_value(name, value)
    values["logprobs_requested"] = _logprobs(body, chat="messages" in body)
    return values


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top logprobs the request asks for: chat `logprobs: true` (+ `top_logprobs: k`),
    completions `logprobs: k`; None when it asks for none. The job's sampling.logprobs computes them
    (prepare.py refuses a request asking more than the job computes)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise RequestProblem(
                "invalid_request", "body.top_logprobs is for chat completions; completions take logprobs: k"
            )
        top, asked = asked, asked is not None
    elif asked not in (None, True, False):
        raise RequestProblem("invalid_request", "body.logprobs must be true or false")
    if not asked:
        if top not in (None, 0):
            raise RequestProblem("invalid_request", "body.top_logprobs needs logprobs: true")
        return None
    if top is None:
        return 0
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise RequestProblem("invalid_request", "the number of top logprobs must be an integer >= 0")
    return top


def _response_format(value: Any) -> str | None:
    """body.response_format as JSON schema text: a json_schema's schema, `{"type": "object"}` for
    json_object; None for text (or null)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if value is None or kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    schema = value.get("json_schema", {}).get("schema") if kind == "json_schema" else None
    if not isinstance(schema, dict):
        raise RequestProblem(
            "invalid_request", "body.response_format must be text, json_object, or json_schema with a schema object"
        )
    return json.dumps(schema)


def _sampling_value(name: str, value: Any) -> Any:
    if name == "stop":
        stops = [value] if isinstance(value, str) else value
        if value is None:
            return None
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise RequestProblem("invalid_request", "body.stop must be a string or a list of strings")
        return stops
    integer = name in ("max_tokens", "max_completion_tokens", "seed")
    kinds = (int,) if integer else (int, float)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        raise RequestProblem("invalid_request", f"body.{name} must be {'an integer' if integer else 'a number'}")
    return float(value) if value is not None and not integer else value
