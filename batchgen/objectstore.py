"""Object storage (`s3://`, `gs://`) through pyarrow.fs: the output prefix and the input objects.

Object stores have no rename and no lock. Each object is serialized in memory and written by one
request, so it is visible whole or not at all (a killed upload leaves nothing under its key). A
part must never replace a committed one: on S3 that is a conditional PutObject (`If-None-Match: *`)
sent with boto3, since pyarrow.fs exposes no conditional write (apache/arrow#44281); where boto3
is missing, or on GCS, an existence check right before the write does it, which leaves a small
race between two writers of the same part (README, "Object storage").
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchgen.dataset import skip_nested_outputs
from batchgen.errors import OutputError
from batchgen.faults import fault_point
from batchgen.storage import REMOTE_SCHEMES, Storage, uri_scheme

log = logging.getLogger(__name__)
_CONFLICT_RETRIES = 3  # S3 answers 409 while another conditional write of the key is in flight


def fs_path(uri: str) -> str:
    """The path pyarrow.fs gives an `s3://` or `gs://` URI: "bucket/prefix"."""
    parts = urlsplit(uri)
    return f"{parts.netloc}{parts.path}".rstrip("/")


def make_filesystem(uri: str, options: dict[str, Any], where: str = "output.path") -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it as "bucket/prefix") for an `s3://` or `gs://` URI; `where` names
    the job key the URI came from, for the message."""
    base = fs_path(uri)
    try:
        if REMOTE_SCHEMES[uri_scheme(uri) or ""] == "s3":
            return pafs.S3FileSystem(**_with_env_endpoint(options)), base
        return pafs.GcsFileSystem(**options), base
    except (pa.ArrowException, OSError, TypeError, ValueError) as exc:
        raise OutputError(f"{where} {uri}: cannot open the object store: {exc}") from exc


def _with_env_endpoint(options: dict[str, Any]) -> dict[str, Any]:
    """AWS_ENDPOINT_URL(_S3), the AWS tools' standard variable, when no endpoint_override is set
    (pyarrow's S3FileSystem reads it only through from_uri; boto3 reads it itself)."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if "endpoint_override" in options or not endpoint:
        return options
    scheme, _, host = endpoint.rpartition("://")
    return {**options, "endpoint_override": host, **({"scheme": scheme} if scheme and "scheme" not in options else {})}


def bucket_problem(fs: pafs.FileSystem, base: str, uri: str) -> str | None:
    """Why `uri`'s bucket cannot be used (missing, no access), or None."""
    bucket = base.split("/", 1)[0]
    try:
        found = fs.get_file_info(bucket).type != pafs.FileType.NotFound
    except (pa.ArrowException, OSError) as exc:
        return f"{uri}: cannot reach bucket {bucket!r}: {exc}"
    return None if found else f"{uri}: bucket {bucket!r} does not exist (batchgen creates no buckets)"


class ObjectStorage(Storage):
    """An output prefix on an object store; names are keys under it."""

    def __init__(self, uri: str, options: dict[str, Any]) -> None:
        self.where = uri
        self.options = options
        self.fs, self.base = make_filesystem(uri, options)
        self.s3 = REMOTE_SCHEMES[uri_scheme(uri) or ""] == "s3"
        self._client: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}  # why: a boto3 client does not pickle (Ray workers)

    def key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def prepare(self) -> None:
        problem = bucket_problem(self.fs, self.base, self.where)
        if problem:
            raise OutputError(f"output.path {problem}")
        probe = f".probe-{os.urandom(8).hex()}"
        try:
            self._put(probe, b"", replace=True)
            self.delete(probe)
        except OSError as exc:
            raise OutputError(f"output.path {self.where}: not writable: {exc}") from exc

    def is_dir(self) -> bool:
        return self._info(self.base).type != pafs.FileType.NotFound

    def exists(self, name: str) -> bool:
        return self._info(self.key(name)).type == pafs.FileType.File

    def read_text(self, name: str) -> str | None:
        try:  # why no exists() first: pyarrow opens with a HEAD + GET already; exists() was a third request
            with self.fs.open_input_stream(self.key(name)) as stream:
                return bytes(stream.read()).decode("utf-8")
        except FileNotFoundError:
            return None

    def write_text(self, name: str, text: str, fault: str, replace: bool = True) -> bool:
        data = text.encode("utf-8")
        fault_point(fault)
        return self._put(name, data, replace)

    def swap_text(self, name: str, text: str, expected: str | None, fault: str) -> bool:
        """On S3 with boto3: a put conditional on the ETag of the very object whose text was compared
        (If-None-Match for a new one). Elsewhere (GCS, no boto3): compare, then put (a window
        remains: README, "Object storage")."""
        data = text.encode("utf-8")
        fault_point(fault)
        if expected is None:
            return self._put(name, data, replace=False)
        client = self._s3_client()
        if client is None:
            if self.read_text(name) != expected:
                return False
            return self._put(name, data, replace=True)
        return self._put_if_unchanged(client, name, data, expected)

    def write_parquet(
        self, name: str, table: pa.Table, fault: str, before_commit: Callable[[bytes], None] | None = None
    ) -> bool:
        sink = pa.BufferOutputStream()  # why in memory: a failed write must never reach the store half
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        if before_commit is not None:
            before_commit(data)
        fault_point(fault)
        return self._put(name, data, replace=False)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.key(name))

    def names(self) -> list[str]:
        selector = pafs.FileSelector(self.base, recursive=False, allow_not_found=True)
        infos = self.fs.get_file_info(selector)
        return [i.base_name for i in infos if i.type == pafs.FileType.File]

    def temp_names(self) -> list[str]:
        return []

    def read_table(self, name: str, columns: list[str]) -> pa.Table:
        return pq.read_table(self.key(name), columns=columns, filesystem=self.fs)

    def read_bytes(self, name: str) -> bytes:
        with self.fs.open_input_stream(self.key(name)) as stream:
            return bytes(stream.read())

    def dataset(self, names: list[str]) -> ds.Dataset:
        return ds.dataset([self.key(n) for n in names], format="parquet", filesystem=self.fs)

    def _info(self, path: str) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(path)
        except (pa.ArrowException, OSError) as exc:
            raise OutputError(f"{self.where}: cannot read the object store: {exc}") from exc

    def _put(self, name: str, data: bytes, replace: bool) -> bool:
        """One request writes the whole object. Without `replace`: a conditional put on S3 when
        boto3 is there, else check-then-put (a race two writers of one key could both win)."""
        if not replace:
            put_new = self._conditional_put()
            if put_new is not None:
                return put_new(name, data)
            if self.exists(name):
                return False
        with self.fs.open_output_stream(self.key(name)) as out:
            out.write(data)
        return True

    def _conditional_put(self) -> Callable[[str, bytes], bool] | None:
        return None if self._s3_client() is None else self._put_if_absent

    def _s3_client(self) -> Any:
        """The boto3 client for conditional writes; None off S3 or without boto3."""
        if not self.s3:
            return None
        if self._client is None:
            self._client = s3_client(self.options, getattr(self.fs, "region", None))
        return None if self._client is False else self._client

    def _bucket_key(self, name: str) -> tuple[str, str]:
        bucket, _, prefix = self.base.partition("/")
        return bucket, f"{prefix}/{name}" if prefix else name

    def _put_if_unchanged(self, client: Any, name: str, data: bytes, expected: str) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = self._bucket_key(name)
        for _ in range(_CONFLICT_RETRIES):
            try:
                got = client.get_object(Bucket=bucket, Key=key)
                if got["Body"].read().decode("utf-8", errors="replace") != expected:
                    return False
                client.put_object(Bucket=bucket, Key=key, Body=data, IfMatch=got["ETag"])
                return True
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in ("NoSuchKey", "PreconditionFailed"):
                    return False  # gone, or another writer changed it in between: the caller reads again
                if code == "NotImplemented":  # a store without If-Match on PUT: compare, then put
                    log.warning("%s: the store refuses If-Match; the job record is written unconditionally", self.where)
                    return self._put(name, data, replace=True)
                if code != "ConditionalRequestConflict":  # 409: another conditional write still in flight
                    raise OSError(f"{self.where}/{name}: {exc}") from exc
        raise OSError(f"{self.where}/{name}: other writers of this key kept conflicting; try again")

    def _put_if_absent(self, name: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        bucket, key = self._bucket_key(name)
        for _ in range(_CONFLICT_RETRIES):
            try:
                self._client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code == "PreconditionFailed":
                    return False  # committed already: that object stands
                if code != "ConditionalRequestConflict":
                    raise OSError(f"{self.where}/{name}: {exc}") from exc
        if self.exists(name):
            return False
        raise OSError(f"{self.where}/{name}: other writers of this key kept conflicting; try again")


def s3_client(options: dict[str, Any], region: str | None) -> Any:
    """A boto3 S3 client with the same endpoint, region and credentials as the pyarrow one; False
    without boto3 (then parts are committed by check-then-put)."""
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        log.warning("boto3 is not installed: parts on S3 are committed by check-then-put (pip install boto3)")
        return False
    config: dict[str, Any] = {}
    if options.get("anonymous"):
        config["signature_version"] = UNSIGNED
    if options.get("force_virtual_addressing"):
        config["s3"] = {"addressing_style": "virtual"}
    for ours, theirs in (("connect_timeout", "connect_timeout"), ("request_timeout", "read_timeout")):
        if ours in options:
            config[theirs] = options[ours]
    kwargs: dict[str, Any] = {"config": Config(**config)}
    if "endpoint_override" in options:
        kwargs["endpoint_url"] = f"{options.get('scheme', 'https')}://{options['endpoint_override']}"
    if options.get("region") or region:
        kwargs["region_name"] = options.get("region") or region
    for ours, theirs in (
        ("access_key", "aws_access_key_id"),
        ("secret_key", "aws_secret_access_key"),
        ("session_token", "aws_session_token"),
    ):
        if ours in options:
            kwargs[theirs] = options[ours]
    return boto3.client("s3", **kwargs)


def discover_objects(fs: pafs.FileSystem, pattern: str, uri: str, exclude: str | None) -> list[tuple[str, str]]:
    """(path in `fs`, key) of an object, the .parquet objects under a prefix (recursively), or a
    glob's objects (`*`, `?`, `[..]` within a name, `**` across folders); keys are relative to the
    prefix (or the glob's leading parts without a wildcard, or the object's own folder)."""
    info = fs.get_file_info(pattern)
    if info.type == pafs.FileType.File:
        return [(pattern, info.base_name)]
    if info.type == pafs.FileType.Directory:
        root = pattern
        listing = _files_under(fs, root)
        found = [p for p in listing if p.endswith(".parquet") and not p.rsplit("/", 1)[-1].startswith(".")]
    else:
        segments = pattern.split("/")
        fixed = next((i for i, s in enumerate(segments) if _has_magic(s)), len(segments))
        root = "/".join(segments[:fixed])
        listing = _files_under(fs, root)
        found = [p for p in listing if _glob_match(segments[fixed:], p[len(root) + 1 :].split("/"))]
    if exclude is not None:
        found = [p for p in found if not p.startswith(exclude.rstrip("/") + "/")]
    records = [p[len(root) + 1 :] for p in listing if p.endswith("/_JOB.json")]
    return skip_nested_outputs(sorted((p, p[len(root) + 1 :]) for p in found), records, f"{uri_scheme(uri)}://{root}")


def _files_under(fs: pafs.FileSystem, root: str) -> list[str]:
    if not root:
        return []
    selector = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    return [i.path for i in fs.get_file_info(selector) if i.type == pafs.FileType.File]


def _has_magic(segment: str) -> bool:
    return any(c in segment for c in "*?[")


def _glob_match(pattern: list[str], parts: list[str]) -> bool:
    """Python glob semantics on "/"-separated keys: `**` spans zero or more folders, and a wildcard
    matches no hidden name (one starting with ".")."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        spans = range(next((i for i, p in enumerate(parts) if p.startswith(".")), len(parts)) + 1)
        return any(_glob_match(pattern[1:], parts[i:]) for i in spans)
    if not parts or (parts[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(pattern[1:], parts[1:])
