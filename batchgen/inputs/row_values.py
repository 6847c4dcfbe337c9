"""Column values to the pieces of a request: a prompt column's text (invalid UTF-8, null and blank
rows fail alone), text-only messages, per-row sampling values, an OpenAI request's logprobs, and
each row's seed. Each failure is a RowError whose code becomes the row's error_code.

Why apart from prepare.py: these are pure functions of a value; the preparer (inputs/prepare)
decides which apply to which column and row.
"""

from __future__ import annotations

import hashlib
from typing import Any, get_type_hints

import pyarrow as pa

from batchgen.engine.api.params import SamplingParams


def asked_logprobs(table: pa.Table) -> list[int | None]:
    """Per row: the top logprobs an OpenAI batch request asks for (None: none, or not such a file)."""
    if "logprobs_requested" not in table.column_names:
        return [None] * table.num_rows
    return table.column("logprobs_requested").to_pylist()


def row_seed(run_seed: int, key: str) -> int:
    """A row's seed from the run seed and the row's id: the same on every run, resume, window
    size and ordering, and different for every row (duplicated prompts draw different samples)."""
    digest = hashlib.sha256(f"{run_seed}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


_INTEGER_FIELDS = {name for name, kind in get_type_hints(SamplingParams).items() if kind in (int, int | None)}


def whole(name: str, value: Any) -> Any:
    """64.0 -> 64 for an integer field (what pandas writes for an int column with nulls); a
    fractional value stays as it is and SamplingParams refuses it (an invalid_sampling row)."""
    if name in _INTEGER_FIELDS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class RowError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def column_values(column: pa.ChunkedArray, as_bytes: bool) -> list[Any]:
    """Python values of a column; string columns come back as raw bytes so that one row with
    invalid UTF-8 fails alone instead of failing the whole conversion."""
    if as_bytes and pa.types.is_string(column.type):
        column = column.cast(pa.binary())
    elif as_bytes and pa.types.is_large_string(column.type):
        column = column.cast(pa.large_binary())
    elif as_bytes and pa.types.is_string_view(column.type):
        column = column.cast(pa.binary_view())
    try:
        return column.to_pylist()
    except (UnicodeDecodeError, pa.ArrowException):
        pass  # some row holds invalid UTF-8: convert row by row so only that row fails
    values: list[Any] = []
    for i in range(len(column)):
        try:
            values.append(column[i].as_py())
        except (UnicodeDecodeError, pa.ArrowException) as exc:
            values.append(RowError("invalid_utf8", f"value cannot be decoded: {exc}"))
    return values


def decode_prompt(value: Any, i: int = 0) -> str:
    if isinstance(value, RowError):
        raise value
    if value is None:
        raise RowError("empty_prompt", "prompt is null")
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RowError("invalid_utf8", f"prompt is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not isinstance(value, str):
        raise RowError("invalid_prompt", f"prompt must be text, got {type(value).__name__}")
    if not value.strip():
        raise RowError("empty_prompt", "prompt is empty or whitespace only")
    return value


def check_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, RowError):
        raise value
    if not value:
        raise RowError("empty_prompt", "messages is null or empty")
    if not isinstance(value, list):
        raise RowError("invalid_messages", f"messages must be a list, got {type(value).__name__}")
    for j, msg in enumerate(value):
        if isinstance(msg, dict) and (isinstance(msg.get("content"), list) or msg.get("parts")):
            why = "content parts (images) are read for a vision-language model only; this model takes text"
            raise RowError("invalid_messages", f"message {j}: {why}")
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise RowError("invalid_messages", f"message {j} must have string 'role' and 'content'")
    if not any(m["content"].strip() for m in value):
        raise RowError("empty_prompt", "every message is empty")
    return [{"role": m["role"], "content": m["content"]} for m in value]
