"""OpenAI-style image content parts in chat messages (as vLLM's `LLM.chat` takes them): the
images pulled out in order, and each part rewritten as the `{"type": "image"}` part that
transformers' chat templates render as the model's placeholder.

Parts taken: {"type": "image_url", "image_url": {"url": data URL | local path}} (or the url as a
plain string), {"type": "image_pil", "image_pil": PIL.Image} and {"type": "image", "image": ...}.
Images are opened lazily (header only; a local path as a LazyImage, which keeps no file open);
pixels are decoded when the request runs.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from batchgen.engine.vision.images import LazyImage

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


def open_image_url(url: str, where: str) -> Any:
    """A data URL (data:image/...;base64,...) or a local path -> a lazily opened PIL image."""
    from PIL import Image, UnidentifiedImageError

    try:
        if url.startswith("data:"):
            header, _, payload = url.partition(",")
            if ";base64" not in header:
                raise ValueError("only base64 data URLs are supported")
            return Image.open(io.BytesIO(base64.b64decode(payload, validate=True)))
        if "://" in url and not url.startswith("file://"):
            raise ValueError("only data URLs and local paths are supported (no downloads)")
        return LazyImage.from_path(url.removeprefix("file://"))  # why: no file stays open (vision/images)
    except (OSError, ValueError, binascii.Error, UnidentifiedImageError) as exc:
        raise ValueError(f"{where}: cannot open image {url[:60]!r}: {exc}") from exc


def _part_image(part: dict[str, Any], where: str) -> Any:
    kind = part["type"]
    value = part.get(kind)
    if kind == "image_url":
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError(f"{where}: image_url part without a url")
        return open_image_url(url, where)
    if isinstance(value, str):
        return open_image_url(value, where)
    if value is None:
        raise ValueError(f"{where}: {kind} part without an image")
    return value


def split_images(conversation: list[dict[str, Any]], where: str) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the conversation with image parts as {"type": "image"}, its images in order)."""
    images: list[Any] = []
    out = []
    for m, message in enumerate(conversation):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                images.append(_part_image(part, f"{where}, message {m}, part {p}"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images
