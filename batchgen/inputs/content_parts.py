"""OpenAI chat content parts in a messages cell: a message's content is text, or a list of parts
`{"type": "text", "text": ...}` and `{"type": "image_url", "image_url": {"url": ...}}` (the url a
`data:image/...;base64,` URL, a local path or an object-store URI), or `{"type": "image", "image":
...}` (bytes, a path, or datasets' {bytes, path}). Each image part becomes `{"type": "image"}`, what
a VLM's chat template renders as its placeholder, and its source is returned in order for
image_cells to read.

Why apart from prepare.py's text messages: a text-only model takes text content only (prepare
checks it); these parts are read only for a vision-language model (vision_rows).
"""

from __future__ import annotations

from typing import Any

from batchgen.inputs.image_cells import CellError

IMAGE_TYPES = ("image_url", "image")


def split_parts(value: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """(messages with image parts as {"type": "image"}, each image part's source in order); CellError
    (code invalid_messages or empty_prompt) naming the message and part that cannot be used."""
    if not value:
        raise CellError("empty_prompt", "messages is null or empty")
    if not isinstance(value, list):
        raise CellError("invalid_messages", f"messages must be a list, got {type(value).__name__}")
    messages: list[dict[str, Any]] = []
    sources: list[Any] = []
    text = False
    for m, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str):
            raise CellError("invalid_messages", f"message {m} must have a string 'role'")
        content = message.get("content")
        if content is None and isinstance(message.get("parts"), list):  # an OpenAI batch request's parts
            content = message["parts"]
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            text = text or bool(content.strip())
            continue
        if not isinstance(content, list):
            raise CellError("invalid_messages", f"message {m}: content must be text or a list of content parts")
        parts = []
        for p, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
                text = text or bool(part["text"].strip())
            elif kind in IMAGE_TYPES:
                sources.append(_source(part, kind, m, p))
                parts.append({"type": "image"})
            else:
                why = "a text part with a string 'text', or an image_url / image part"
                raise CellError("invalid_messages", f"message {m}, part {p}: must be {why}")
        messages.append({"role": role, "content": parts})
    if not text and not sources:
        raise CellError("empty_prompt", "every message is empty")
    return messages, sources


def _source(part: dict[str, Any], kind: str, m: int, p: int) -> Any:
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")
    if value is None or value == "":
        raise CellError("invalid_messages", f"message {m}, part {p}: {kind} part without an image")
    return value
