"""One request's images as the engine holds them: a content hash fixed at add time (from the
image's encoded bytes when it was opened from a file or bytes, else from its pixels), its size
from the header, and its pixels decoded only when the tower needs them.

Why lazily: a job hands the engine a whole part's requests at once; decoding every image then
would hold them all in memory. An image opened with `PIL.Image.open` has read its header only,
so its size (and so its token count) is known for free; `.convert("RGB")` happens when the
request's image tokens are first scheduled, and a failure there is that request's error.

Why LazyImage: a PIL image opened from a path keeps its file open until it is decoded or closed,
so 10,000 such prompts would hold 10,000 file handles. A LazyImage is a path (or encoded bytes)
with its size and content hash, read once and closed; `decode` opens the file, decodes it and
closes it. The job hands the engine its images this way, chat() opens local paths this way, and
a PIL image the caller opened from a file is held by its path only.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HASH_TAG = b"batchgen-image-v1"


class ImageDecodeError(ValueError):
    """An image of a request could not be decoded; the message names the image's index."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"image {index}: cannot decode: {reason}")
        self.reason = reason


@dataclass(frozen=True, eq=False)
class LazyImage:
    """An image known by a local file `path` (or its encoded `data`), its size and content hash;
    nothing stays open (see the module docstring)."""

    width: int
    height: int
    content_hash: bytes
    path: str = ""
    data: bytes = b""

    @classmethod
    def from_path(cls, path: str | Path) -> LazyImage:
        """Read the file once (its header for the size, its bytes for the hash) and close it;
        OSError or PIL's UnidentifiedImageError when it cannot be read or is no image."""
        from PIL import Image

        encoded = Path(path).read_bytes()
        with Image.open(io.BytesIO(encoded)) as image:
            width, height = image.size
        return cls(int(width), int(height), encoded_hash(encoded), path=str(path))

    def open(self) -> Any:
        """A new, lazily opened PIL image of it (the caller closes it)."""
        from PIL import Image

        return Image.open(self.path) if self.path else Image.open(io.BytesIO(self.data))

    def decode(self) -> Any:
        """Its RGB pixels as a PIL image, the file closed again."""
        with self.open() as image:
            return image.convert("RGB")


@dataclass(frozen=True, eq=False)
class RequestImage:
    """One image of a request: `index` among the request's images, its size and content hash."""

    index: int
    image: Any  # a LazyImage, or a PIL.Image.Image possibly not yet decoded
    width: int
    height: int
    content_hash: bytes

    def decode(self) -> Any:
        """The image as decoded RGB pixels (a PIL image); ImageDecodeError naming the image.

        Why a fresh image when it was opened lazily: decoding the caller's own object would leave
        its pixels loaded there, so a job holding a part's prompts would end up holding every
        decoded image of the part; the fresh one is dropped once the tower has read it."""
        try:
            if isinstance(self.image, LazyImage):
                return self.image.decode()
            fresh = _reopened(self.image)
            if fresh is None:
                return self.image.convert("RGB")
            with fresh:
                return fresh.convert("RGB")
        except Exception as exc:  # why broad: Pillow raises OSError, ValueError, SyntaxError, ...
            raise ImageDecodeError(self.index, str(exc)) from exc


def _reopened(image: Any) -> Any:
    """A new lazily opened image from the bytes `image` was opened from, or None (made in memory)."""
    from PIL import Image

    encoded = _encoded_bytes(image)
    return None if encoded is None else Image.open(io.BytesIO(encoded))


def _encoded_bytes(image: Any) -> bytes | None:
    """The encoded bytes an image was opened from (a file or an in-memory buffer), or None."""
    fp = getattr(image, "fp", None)
    if isinstance(fp, io.BytesIO):
        return fp.getvalue()
    filename = getattr(image, "filename", "")
    if filename and Path(filename).is_file():
        return Path(filename).read_bytes()
    return None


def encoded_hash(encoded: bytes) -> bytes:
    """The content hash of an image given as its encoded bytes (what content_hash gives such an image)."""
    h = hashlib.blake2b(_HASH_TAG, digest_size=16)
    h.update(b"encoded")
    h.update(encoded)
    return h.digest()


def content_hash(image: Any) -> bytes:
    """blake2b of the image's encoded bytes when known (no decoding), else of its mode, size and
    pixels. Equal bytes give equal hashes, so equal images share prefix-cache blocks."""
    encoded = _encoded_bytes(image)
    if encoded is not None:
        return encoded_hash(encoded)
    h = hashlib.blake2b(_HASH_TAG, digest_size=16)
    h.update(f"pixels {image.mode} {image.size[0]}x{image.size[1]}".encode())
    h.update(image.tobytes())
    return h.digest()


def request_images(images: Any, where: str) -> list[RequestImage]:
    """multi_modal_data["image"] (one PIL image or LazyImage, or a list) -> RequestImages;
    TypeError naming `where` (e.g. "prompt 3") for anything else. A PIL image opened from a file
    is held by its path (LazyImage): the engine keeps none of the caller's file handles alive."""
    from PIL import Image

    items = list(images) if isinstance(images, (list, tuple)) else [images]
    out = []
    for i, image in enumerate(items):
        if isinstance(image, LazyImage):
            out.append(RequestImage(i, image, image.width, image.height, image.content_hash))
            continue
        if not isinstance(image, Image.Image):
            raise TypeError(f"{where}: image {i} must be a PIL.Image.Image, got {type(image).__name__}")
        filename = getattr(image, "filename", "")
        if filename and not isinstance(getattr(image, "fp", None), io.BytesIO) and Path(filename).is_file():
            lazy = LazyImage.from_path(filename)
            out.append(RequestImage(i, lazy, lazy.width, lazy.height, lazy.content_hash))
            continue
        width, height = image.size
        out.append(RequestImage(i, image, int(width), int(height), content_hash(image)))
    return out
