"""A choice's `logprobs` in the OpenAI batch output file, from the parts' `logprobs` column (the job's
`sampling.logprobs`), cut to the top K the request asked for, in the endpoint's own shape:
chat `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`, completions `{tokens,
token_logprobs, top_logprobs: [{token: logprob}], text_offset}`."""

from __future__ import annotations

from typing import Any


def choice_logprobs(entries: list[dict[str, Any]] | None, k: int, chat: bool) -> dict[str, Any] | None:
    """`entries`: one sample's TOKEN_LOGPROB structs (outputs/samples.py); `k`: top logprobs asked."""
    if entries is None:
        return None
    if chat:
        return {"content": [_chat_token(e, k) for e in entries]}
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        at += len(e["token"] or "")
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top"][:k]} for e in entries],
        "text_offset": offsets,
    }


def _chat_token(entry: dict[str, Any], k: int) -> dict[str, Any]:
    return {
        "token": entry["token"],
        "logprob": entry["logprob"],
        "bytes": _bytes(entry["token"]),
        "top_logprobs": [
            {"token": t["token"], "logprob": t["logprob"], "bytes": _bytes(t["token"])} for t in entry["top"][:k]
        ],
    }


def _bytes(token: str | None) -> list[int] | None:
    return None if token is None else list(token.encode("utf-8"))
