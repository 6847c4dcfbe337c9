"""Where a job's output lives: a local folder or an object-store prefix (`s3://`, `gs://`).

Everything that reads or writes the output folder goes through a `Storage`: list the committed
parts, read and write the small JSON files, read parts back, commit a part whole without ever
replacing one, swap the job record only over the one a run read. `LocalStorage` is the local
protocol (temp file, fsync, rename or hard link, flocks: the run's in `outputs.state.OutputLock`, the
record swap's own); `objectstore.ObjectStorage` is the object-store one (each object written by
one request, visible whole or not at all, conditionally where it must not replace another; no
rename, no flock: the run lock is a lease, outputs/lease.py). Paths and their `storage_options` are
checked here too, so a typo fails at load, before any work.
"""

from __future__ import annotations

import fcntl
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchgen.errors import OutputError

REMOTE_SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}  # URI scheme -> store
PART_NAME = re.compile(r"part-(\d{6})\.parquet")  # only these are ours; a stray part-old.parquet is not
# A file is written under a temp name, then committed under its final name. Why this exact pattern:
# a user's own hidden `.notes.tmp` in the output folder must never be taken for ours and deleted.
# (Older batchgen wrote ".<final>.<hex>.tmp": still matched, so its leftovers are cleaned too.)
_TEMP_PREFIX = ".batchgen."
TEMP_NAME = re.compile(r"\.(?:batchgen\.)?(part-\d{6}\.parquet|_SUCCESS|_JOB\.json|probe)\.[0-9a-f]{32}\.tmp")
_TEXT, _FLAG, _SECONDS = (str,), (bool,), (int, float)
STORE_OPTIONS: dict[str, dict[str, tuple[type, ...]]] = {
    # pyarrow.fs.S3FileSystem / GcsFileSystem keyword arguments a job may set (the rest stay defaults).
    "s3": {
        "access_key": _TEXT,
        "secret_key": _TEXT,
        "session_token": _TEXT,
        "region": _TEXT,
        "endpoint_override": _TEXT,
        "scheme": _TEXT,
        "anonymous": _FLAG,
        "request_timeout": _SECONDS,
        "connect_timeout": _SECONDS,
        "force_virtual_addressing": _FLAG,
    },
    "gcs": {"anonymous": _FLAG, "endpoint_override": _TEXT, "scheme": _TEXT, "project_id": _TEXT},
}
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def uri_scheme(path: str | Path) -> str | None:
    """The lower-case scheme of a URI (`s3`, `file`, ...); None for a plain path."""
    match = _SCHEME.match(path) if isinstance(path, str) else None
    return match.group(1).lower() if match else None


def is_remote(path: str | Path) -> bool:
    """Whether `path` names an object store (`s3://`, `gs://`) rather than the local file system."""
    return uri_scheme(path) in REMOTE_SCHEMES


def local_path(path: str) -> str:
    """A `file://` URI as a plain path; any other path unchanged."""
    return urlsplit(path).path if uri_scheme(path) == "file" else path


def nested_output_parts(keys: list[str], records: list[str]) -> dict[str, list[str]]:
    """Of `keys` (input files, "/"-separated paths below the input's root), the committed parts of
    batchgen outputs nested below that root, by folder: a folder holding a `_JOB.json` (listed in
    `records`, paths below the same root). Why: an older run's output left inside an input folder
    would be read as input. The root itself is left alone: an input.path that names an output folder
    reads it on purpose. `_SUCCESS` alone proves nothing (Spark and Hadoop write one too)."""
    folders = {r.rpartition("/")[0] for r in records if r.rpartition("/")[2] == "_JOB.json" and "/" in r}
    found: dict[str, list[str]] = {}
    for key in keys:
        folder, _, name = key.rpartition("/")
        if folder in folders and PART_NAME.fullmatch(name):
            found.setdefault(folder, []).append(key)
    return found


def temp_name(final: str) -> str:
    """The hidden name `final` is written under before its commit: ".batchgen.<final>.<32 hex>.tmp"."""
    name = f"{_TEMP_PREFIX}{final}.{uuid.uuid4().hex}.tmp"
    if not TEMP_NAME.fullmatch(name):
        raise ValueError(f"{final!r} is not a file batchgen writes in an output folder")
    return name


def temp_target(name: str) -> str | None:
    """The final name a temp file of ours (see temp_name) was written for; None for any other file."""
    match = TEMP_NAME.fullmatch(name)
    return match.group(1) if match else None


def display_uri(uri: str | Path) -> str:
    """A path or URI as every message, log line and manifest shows it: the one redaction. A URI
    loses its query and fragment (`?access_key=..&secret_key=..` may carry credentials) and any
    user info (`s3://KEY:SECRET@bucket`); a plain local path is shown as it is (`?` is a file
    name character there)."""
    text = str(uri)
    scheme = _SCHEME.match(text)
    if scheme is None:
        return text
    rest = re.split(r"[?#]", text[scheme.end() :], maxsplit=1)[0]
    authority, slash, path = rest.partition("/")
    return f"{scheme.group(0)}{authority.rpartition('@')[2]}{slash}{path}".rstrip("/")


def check_storage_options(path: str | Path, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`options` checked for the store `path` names (ValueError naming the key); normalized:
    an `endpoint_override` spelled with a scheme (`http://host:port`) is split into both."""
    scheme = uri_scheme(path)
    if scheme is not None and scheme != "file" and scheme not in REMOTE_SCHEMES:
        raise ValueError(f"{where}.path: unsupported URI scheme {scheme}:// (use s3://, gs://, file://, a local path)")
    if scheme in REMOTE_SCHEMES and not urlsplit(str(path)).netloc:
        raise ValueError(f"{where}.path: {display_uri(str(path))} names no bucket ({scheme}://BUCKET/PREFIX)")
    if scheme not in REMOTE_SCHEMES:
        if options:
            raise ValueError(f"{where}.storage_options: only for s3:// or gs:// paths, and {where}.path is local")
        return {}
    allowed = STORE_OPTIONS[REMOTE_SCHEMES[scheme]]
    out = dict(options)
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(
                f"{where}.storage_options: unknown key {key!r} for {scheme}:// (known: {', '.join(sorted(allowed))})"
            )
        kinds = allowed[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            expected = {_TEXT: "a string", _FLAG: "true or false", _SECONDS: "a number of seconds"}[kinds]
            raise ValueError(f"{where}.storage_options.{key}: must be {expected}")
    endpoint = out.get("endpoint_override")
    if endpoint is not None and "://" in endpoint:
        given, _, out["endpoint_override"] = endpoint.partition("://")
        if out.setdefault("scheme", given) != given:
            raise ValueError(f"{where}.storage_options: endpoint_override is {given}:// but scheme is {out['scheme']}")
    if out.get("scheme", "https") not in ("http", "https"):
        raise ValueError(f"{where}.storage_options.scheme: must be http or https")
    return out


def options_from_uri(uri: str, options: Mapping[str, Any] | None, where: str) -> tuple[str, dict[str, Any]]:
    """(the URI without its query, checked options): a query (`?endpoint_override=...&scheme=http`,
    handy for `report` and `finalize`) adds to `options`; "true"/"false" and numbers are converted."""
    merged = dict(options or {})
    for key, text in parse_qsl(urlsplit(uri).query, keep_blank_values=True):
        merged[key] = _query_value(text, STORE_OPTIONS.get(REMOTE_SCHEMES.get(uri_scheme(uri) or "", ""), {}).get(key))
    try:
        return display_uri(uri), check_storage_options(uri, merged, where)
    except ValueError as exc:
        raise OutputError(str(exc)) from None


def _query_value(text: str, kinds: tuple[type, ...] | None) -> Any:
    if kinds == _FLAG and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kinds == _SECONDS:
        try:
            return float(text)
        except ValueError:
            return text
    return text


class Storage(ABC):
    """One output folder or prefix; files are named relative to it (`_JOB.json`, `part-000003.parquet`)."""

    where: str  # the folder or URI, for messages
    local_dir: Path | None = None  # the folder when local: flocks and hard links work there
    guard: Callable[[], None] | None = None  # an object store: checks the run still holds its lease

    @abstractmethod
    def prepare(self) -> None:
        """Create the folder if needed and check it can be written; OutputError otherwise."""

    @abstractmethod
    def is_dir(self) -> bool: ...

    @abstractmethod
    def exists(self, name: str) -> bool: ...

    @abstractmethod
    def read_text(self, name: str) -> str | None:
        """The file's text; None when there is no such file."""

    @abstractmethod
    def write_text(self, name: str, text: str, fault: str, replace: bool = True) -> bool:
        """Write `name` whole (never half visible); with `replace=False` keep an existing one and
        return False. `fault` names the crash-test point between preparing and committing."""

    @abstractmethod
    def swap_text(self, name: str, text: str, expected: str | None, fault: str) -> bool:
        """Write `name` whole only if its text is still `expected` (None: there is no such file);
        False, and nothing written, when it is not. Atomic against any other swap of `name`."""

    @abstractmethod
    def write_parquet(
        self, name: str, table: pa.Table, fault: str, before_commit: Callable[[bytes], None] | None = None
    ) -> bool:
        """Commit `table` as `name` whole; False (and the existing file kept) when it exists.
        `before_commit` gets the exact bytes about to be committed, before they can be seen."""

    @abstractmethod
    def delete(self, name: str) -> None: ...

    @abstractmethod
    def names(self) -> list[str]:
        """The files directly inside (not in sub-folders)."""

    @abstractmethod
    def temp_names(self) -> list[str]:
        """Temp files a killed writer left (none on object stores: nothing is written half)."""

    @abstractmethod
    def read_table(self, name: str, columns: list[str]) -> pa.Table: ...

    @abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """The whole file (FileNotFoundError when there is none)."""

    @abstractmethod
    def dataset(self, names: list[str]) -> ds.Dataset: ...

    def committed_parts(self) -> dict[int, str]:
        """Committed parts by index, as names (only `part-NNNNNN.parquet` files are ours)."""
        found = {int(m.group(1)): n for n in self.names() if (m := PART_NAME.fullmatch(n))}
        return dict(sorted(found.items()))

    def describe(self, name: str) -> str:
        return f"{self.where}/{name}"


class LocalStorage(Storage):
    """A local folder, written with batchgen's local protocol (`parts.atomic_write`)."""

    def __init__(self, folder: Path) -> None:
        self.local_dir = Path(folder)
        self.folder = self.local_dir
        self.where = str(folder)

    def prepare(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / temp_name("probe")
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"output.path {self.folder}: not writable: {exc.strerror or exc}") from exc

    def is_dir(self) -> bool:
        return self.folder.is_dir()

    def exists(self, name: str) -> bool:
        return (self.folder / name).exists()

    def read_text(self, name: str) -> str | None:
        try:
            return (self.folder / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str, fault: str, replace: bool = True) -> bool:
        from batchgen.outputs.parts import atomic_write

        return atomic_write(self.folder / name, lambda tmp: tmp.write_text(text, encoding="utf-8"), fault, replace)

    def swap_text(self, name: str, text: str, expected: str | None, fault: str) -> bool:
        """Compare and write under an exclusive flock of `.batchgen.NAME.lock` (dropped if we die)."""
        fd = os.open(self.folder / f".batchgen.{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self.read_text(name) != expected:
                return False
            return self.write_text(name, text, fault, replace=expected is not None)
        finally:
            os.close(fd)  # drops the flock

    def write_parquet(
        self, name: str, table: pa.Table, fault: str, before_commit: Callable[[bytes], None] | None = None
    ) -> bool:
        from batchgen.outputs.parts import atomic_write

        def write(tmp: Path) -> None:
            pq.write_table(table, tmp)
            if before_commit is not None:
                before_commit(tmp.read_bytes())  # why read back: the bytes on disk are the ones described

        return atomic_write(self.folder / name, write, fault, replace=False)

    def delete(self, name: str) -> None:
        (self.folder / name).unlink(missing_ok=True)

    def names(self) -> list[str]:
        return [p.name for p in self.folder.iterdir() if p.is_file()] if self.folder.is_dir() else []

    def temp_names(self) -> list[str]:
        """Our temp files only (see temp_name): other hidden files here are the user's."""
        return [p.name for p in self.folder.glob(".*.tmp") if temp_target(p.name) is not None]

    def read_table(self, name: str, columns: list[str]) -> pa.Table:
        return pq.read_table(self.folder / name, columns=columns)

    def read_bytes(self, name: str) -> bytes:
        return (self.folder / name).read_bytes()

    def dataset(self, names: list[str]) -> ds.Dataset:
        return ds.dataset([str(self.folder / n) for n in names], format="parquet")


def open_storage(
    path: str | Path | Storage, options: Mapping[str, Any] | None = None, single_writer: bool = False
) -> Storage:
    """The Storage for an output path: a local folder (a plain path or `file://`) or an object-store
    URI, with its `storage_options` (a URI's query may add some). `single_writer`: see
    objectstore.ObjectStorage (a local folder always has atomic commits and needs no such mode)."""
    if isinstance(path, Storage):
        return path
    if not is_remote(path):
        if options:
            raise OutputError(f"output.storage_options: only for s3:// or gs:// paths, and {path} is local")
        return LocalStorage(Path(local_path(path) if isinstance(path, str) else path))
    from batchgen.storage.objectstore import ObjectStorage

    uri, checked = options_from_uri(str(path), options, "output")
    return ObjectStorage(uri, checked, single_writer)
