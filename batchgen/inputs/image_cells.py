"""A row's images from its `input.image_column` cell: bytes, a path (relative to the input file, or
an object-store / file:// URI), a `data:image/...;base64,` URL, the `{bytes, path}` struct that
Hugging Face `datasets` writes for its Image feature, or a list of these.

Why only a header and a hash here: a part is read and prepared before the engine runs it, so
everything made here lives for the whole part. An image is read as its file's bytes, its size
taken from the header Pillow reads on open (no pixel is decoded), and its content hashed; a local
file is then kept as its path alone (no bytes, no open file), other images as their encoded
bytes. The engine decodes each when its tokens are scheduled (LLM.generate with LazyImages).
A cell that cannot be read (a missing path, bytes that are no image, an image above
`input.max_image_pixels`) raises CellError naming the image; the row becomes an error row.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import posixpath
import warnings
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

from batchgen.storage.retry import RetryPolicy, is_transient, with_retries
from batchgen.storage.uris import display_uri, is_remote, local_path, uri_scheme


class CellError(Exception):
    """Why one row's image cannot be used; `code` becomes the row's error_code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ImageData:
    """One image of a row: where it came from, its size and content hash, and its compressed
    bytes unless it is a local file (`path`), read again when the engine decodes it."""

    data: bytes
    source: str  # for messages: the path or URI, or "bytes"
    width: int
    height: int
    content_hash: bytes  # engine/vision/images.content_hash: of the encoded bytes (what the prefix key covers)
    path: str = ""  # a local file's path (then `data` is empty)

    def open(self) -> Any:
        """The engine's LazyImage of it: size and hash, no pixels and no open file (decoded, and
        a file opened, only while the engine's tower needs it)."""
        from batchgen.engine.vision.images import LazyImage

        return LazyImage(self.width, self.height, self.content_hash, path=self.path, data=self.data)


@dataclass(frozen=True)
class Folder:
    """Where a relative image path resolves: the input file's folder, locally (`fs` None) or in an
    object store (`fs` the input's pyarrow FileSystem, `path` "bucket/prefix")."""

    path: str
    fs: Any = None
    uri: str = ""  # the input file's URI on a store, for messages


class ImageReader:
    """Reads image cells into ImageData; one per job process (it keeps the object stores it opened)."""

    def __init__(self, max_pixels: int | None, storage_options: dict[str, Any], input_scheme: str | None) -> None:
        from PIL import Image

        # None: no limit (only where Pillow's own guard was turned off, MAX_IMAGE_PIXELS = None)
        self.max_pixels: int | None = max_pixels if max_pixels is not None else Image.MAX_IMAGE_PIXELS
        # Why raised: Pillow refuses images above twice its own guard at open; the job's limit is the rule.
        if (
            Image.MAX_IMAGE_PIXELS is not None
            and self.max_pixels is not None
            and self.max_pixels > Image.MAX_IMAGE_PIXELS
        ):
            Image.MAX_IMAGE_PIXELS = self.max_pixels
        self.options, self.input_scheme = storage_options, input_scheme
        self.stores: dict[str, Any] = {}  # "scheme://bucket" -> pyarrow FileSystem
        # (folder, location) -> its image, for one table's rows (forget_locations): a catalogue's
        # questions about one image read, parse and hash it once, and share its bytes
        self.locations: dict[tuple[str, str], ImageData] = {}
        self.policy = RetryPolicy.from_env()

    def read_cell(self, cell: Any, folder: Folder | None) -> list[ImageData]:
        """The images of one cell, in order; CellError for a cell that names no image or a bad one."""
        items = list(cell) if isinstance(cell, (list, tuple)) else [cell]
        if cell is None or not items:
            raise CellError("missing_image", "the image column is null or empty")
        return [self.image(j, item, folder) for j, item in enumerate(items)]

    def image(self, j: int, item: Any, folder: Folder | None) -> ImageData:
        """Image `j` of a row from one value: bytes, a path / URI / data URL, or a {bytes, path} struct."""
        if isinstance(item, dict) and item.get("bytes") is None:
            item = item.get("path")
        key = (folder.path if folder is not None else "", item) if isinstance(item, str) else None
        known = self.locations.get(key) if key is not None else None
        if known is not None:
            return known
        data, source, path = self._bytes(j, item, folder)
        image = self.checked(j, data, source)
        if path:  # a local file: its path is enough (read again when decoded)
            image = dataclasses.replace(image, data=b"", path=path)
        if key is not None and not item.startswith("data:"):
            self.locations[key] = image
        return image

    def forget_locations(self) -> None:
        """Start a new table: the images read by location so far are no longer shared."""
        self.locations.clear()

    def checked(self, j: int, data: bytes, source: str) -> ImageData:
        """ImageData of image `j` from its bytes: header read, size checked, content hashed."""
        from PIL import Image, UnidentifiedImageError

        from batchgen.engine.vision.images import content_hash

        where = f"image {j} ({source})"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # why: the limit below decides
            try:
                with Image.open(BytesIO(data)) as image:
                    width, height = image.size
                    digest = content_hash(image)  # the engine's own hash: job keys equal its block hashes
            except Image.DecompressionBombError as exc:
                raise CellError("image_too_large", f"{where}: {exc}") from None
            except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
                raise CellError("invalid_image", f"{where}: not a readable image: {exc}") from None
        if self.max_pixels is not None and width * height > self.max_pixels:
            why = f"{width}x{height} = {width * height} pixels, above input.max_image_pixels ({self.max_pixels})"
            raise CellError("image_too_large", f"{where}: {why}")
        return ImageData(data, source, width, height, digest)

    def _bytes(self, j: int, item: Any, folder: Folder | None) -> tuple[bytes, str, str]:
        """(encoded bytes, source, the local file's path or "")."""
        if isinstance(item, dict):  # datasets' Image feature: {bytes, path}; the bytes win when both are set
            if item.get("bytes") is not None:
                return self._bytes(j, item["bytes"], folder)
            item = item.get("path")
        if isinstance(item, (bytes, bytearray, memoryview)):
            return bytes(item), "bytes", ""
        if isinstance(item, str) and item.strip():
            return self.read_location(j, item.strip(), folder)
        raise CellError("missing_image", f"image {j}: null, empty or not an image value ({type(item).__name__})")

    def read_location(self, j: int, where: str, folder: Folder | None) -> tuple[bytes, str, str]:
        """(bytes, source, the local file's path or "") of a path, URI or data URL."""
        if where.startswith("data:"):
            return _data_url(j, where), "data URL", ""
        if is_remote(where):
            return self._read_store(j, where), display_uri(where), ""
        if uri_scheme(where) not in (None, "file"):
            raise CellError("invalid_image", f"image {j} ({where}): unsupported URI scheme (use s3://, gs://, a path)")
        path = local_path(where)
        if folder is not None and folder.fs is not None and not Path(path).is_absolute():
            key = posixpath.normpath(posixpath.join(folder.path, path))
            return self._read_fs(j, folder.fs, key, f"{folder.uri.rsplit('/', 1)[0]}/{path}"), path, ""
        full = Path(path) if folder is None or Path(path).is_absolute() else Path(folder.path) / path
        try:
            return full.read_bytes(), str(full), str(full)
        except OSError as exc:
            raise CellError("invalid_image", f"image {j} ({full}): cannot be read: {exc.strerror or exc}") from None

    def _read_store(self, j: int, uri: str) -> bytes:
        from batchgen.storage.objectstore import fs_path, make_filesystem

        scheme = uri_scheme(uri) or ""
        bucket = fs_path(uri).split("/", 1)[0]
        key = f"{scheme}://{bucket}"
        if key not in self.stores:  # the input's storage_options serve images on the input's kind of store
            options = self.options if scheme == self.input_scheme else {}
            self.stores[key] = make_filesystem(uri, options, "input.image_column")[0]
        return self._read_fs(j, self.stores[key], fs_path(uri), display_uri(uri))

    def _read_fs(self, j: int, fs: Any, path: str, shown: str) -> bytes:
        def read() -> bytes:
            with fs.open_input_file(path) as f:
                return bytes(f.read())

        try:
            return with_retries(read, shown, f"read image {j}", self.policy)
        except Exception as exc:
            if is_transient(exc) or not isinstance(exc, OSError):
                raise
            raise CellError("invalid_image", f"image {j} ({shown}): cannot be read: {exc}") from None


def _data_url(j: int, url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    head, _, payload = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise CellError("invalid_image", f"image {j}: a data URL must be data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CellError("invalid_image", f"image {j}: the data URL's base64 does not decode: {exc}") from None
