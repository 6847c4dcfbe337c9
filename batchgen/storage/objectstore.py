"""Object storage (`s3://`, `gs://`) through pyarrow.fs: the output prefix and the input objects.

Object stores have no rename and no flock. Each object is serialized in memory and written by one
request, so it is visible whole or not at all (a killed upload leaves nothing under its key). What
must never be replaced (a committed part) or must be replaced only over what was read (the job
record, the run's lease) is written conditionally: on S3 with boto3 (s3.py), on GCS
with google-cloud-storage (gcs.py), since pyarrow.fs sends no precondition
(apache/arrow#44281). Before a run writes anything, a probe checks that the store honours those
preconditions; where it cannot (the library missing, a store that ignores or refuses them) the run
is refused unless the user declared a single writer (`output.single_writer`), and then an existence
check right before each write takes their place. Every request is retried on transient errors
(retry.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchgen.errors import OutputError
from batchgen.faults import fault_point
from batchgen.storage.base import Storage
from batchgen.storage.gcs import GcsConditional, gcs_client
from batchgen.storage.retry import RetryPolicy, is_transient, with_retries
from batchgen.storage.s3 import S3Conditional, s3_client
from batchgen.storage.uris import REMOTE_SCHEMES, uri_scheme

log = logging.getLogger(__name__)
T = TypeVar("T")


def fs_path(uri: str) -> str:
    """The path pyarrow.fs gives an `s3://` or `gs://` URI: "bucket/prefix"."""
    parts = urlsplit(uri)
    return f"{parts.netloc}{parts.path}".rstrip("/")


def make_filesystem(
    uri: str, options: dict[str, Any], where: str = "output.path", attempts: int | None = None
) -> tuple[pafs.FileSystem, str]:
    """(file system, path inside it as "bucket/prefix") for an `s3://` or `gs://` URI; `where` names
    the job key the URI came from, for the message. `attempts`: how often the AWS SDK itself tries
    each S3 request (inputs: their rows stream through pyarrow, where no call of ours can retry)."""
    base = fs_path(uri)
    try:
        if REMOTE_SCHEMES[uri_scheme(uri) or ""] == "s3":
            extra = {"retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=attempts)} if attempts else {}
            return pafs.S3FileSystem(**_with_env_endpoint(options), **extra), base
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
        if is_transient(exc):
            raise  # the caller's retries decide
        return f"{uri}: cannot reach bucket {bucket!r}: {exc}"
    return None if found else f"{uri}: bucket {bucket!r} does not exist (batchgen creates no buckets)"


class ObjectStorage(Storage):
    """An output prefix on an object store; names are keys under it."""

    def __init__(
        self, uri: str, options: dict[str, Any], single_writer: bool = False, policy: RetryPolicy | None = None
    ) -> None:
        self.where = uri
        self.options = options
        self.single_writer = single_writer
        self.policy = policy or RetryPolicy.from_env()
        self.fs, self.base = make_filesystem(uri, options)
        self.store = REMOTE_SCHEMES[uri_scheme(uri) or ""]  # "s3" | "gcs"
        self._writes: Any = None  # the conditional writer, made on first use
        self._fallback: bool | None = None  # None: not probed yet; True: check-then-put (single writer)

    def __getstate__(self) -> dict[str, Any]:
        # Why: a boto3 / google client does not pickle (Ray workers), nor does the driver's lease check.
        return {**self.__dict__, "_writes": None, "guard": None}

    def key(self, name: str) -> str:
        return f"{self.base}/{name}"

    def prepare(self) -> None:
        problem = self._retry("check the bucket", lambda: bucket_problem(self.fs, self.base, self.where))
        if problem:
            raise OutputError(f"output.path {problem}")
        self.conditional()  # refused here, before any work, where parts could be committed twice
        probe = f".probe-{os.urandom(8).hex()}"
        try:
            self._plain_put(probe, b"")
            self.delete(probe)
        except OSError as exc:
            raise OutputError(f"output.path {self.where}: not writable: {exc}") from exc

    def conditional(self) -> Conditional | None:
        """The store's conditional writer; None in single-writer mode (check-then-put). The first
        call probes the store; OutputError when it cannot do conditional writes and no single
        writer was declared."""
        if self._fallback is None:
            why = self._why_not_conditional()
            if why is not None and not self.single_writer:
                raise OutputError(
                    f"output.path {self.where}: {why}, so two runs could both commit one part. Fix that, or, "
                    "if only one run at a time ever writes this output, set output.single_writer: true "
                    "(or pass --single-writer)"
                )
            if why is not None:
                log.warning("%s: %s; single-writer mode: parts are committed by check-then-put", self.where, why)
            self._fallback = why is not None
        return None if self._fallback else self._writer()

    def is_dir(self) -> bool:
        return self._info(self.base).type != pafs.FileType.NotFound

    def exists(self, name: str) -> bool:
        return self._info(self.key(name)).type == pafs.FileType.File

    def read_text(self, name: str) -> str | None:
        data = self._read_bytes(name)
        return None if data is None else data.decode("utf-8")

    def write_text(self, name: str, text: str, fault: str, replace: bool = True) -> bool:
        data = text.encode("utf-8")
        fault_point(fault)
        return self._put(name, data, replace)

    def swap_text(self, name: str, text: str, expected: str | None, fault: str) -> bool:
        """A put conditional on the version of the very object whose text was compared (If-Match
        on its ETag, ifGenerationMatch on its generation); a new one only if there is none.
        Single-writer mode: compare, then put."""
        data = text.encode("utf-8")
        fault_point(fault)
        if expected is None:
            return self._put(name, data, replace=False)
        if self.guard is not None:
            self.guard()
        writer = self.conditional()
        if writer is None:
            if self.read_text(name) != expected:
                return False
            self._plain_put(name, data)
            return True
        return bool(writer.swap(self._bucket_key(name)[1], data, expected.encode("utf-8")))

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
        if self.guard is not None:
            self.guard()

        def drop() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.delete_file(self.key(name))

        self._retry("delete", drop, name)

    def names(self) -> list[str]:
        selector = pafs.FileSelector(self.base, recursive=False, allow_not_found=True)
        infos = self._retry("list", lambda: self.fs.get_file_info(selector))
        return [i.base_name for i in infos if i.type == pafs.FileType.File]

    def temp_names(self) -> list[str]:
        return []

    def read_table(self, name: str, columns: list[str]) -> pa.Table:
        return self._retry("read", lambda: pq.read_table(self.key(name), columns=columns, filesystem=self.fs), name)

    def read_bytes(self, name: str) -> bytes:
        def read() -> bytes:
            with self.fs.open_input_stream(self.key(name)) as stream:
                return bytes(stream.read())

        return self._retry("read", read, name)

    def dataset(self, names: list[str]) -> ds.Dataset:
        return ds.dataset([self.key(n) for n in names], format="parquet", filesystem=self.fs)

    def _retry(self, what: str, call: Callable[[], T], name: str | None = None) -> T:
        return with_retries(call, self.describe(name) if name else self.where, what, self.policy)

    def _info(self, path: str) -> pafs.FileInfo:
        try:
            return self._retry("look up", lambda: self.fs.get_file_info(path))
        except (pa.ArrowException, OSError) as exc:
            raise OutputError(f"{self.where}: cannot read the object store: {exc}") from exc

    def _read_bytes(self, name: str) -> bytes | None:
        """The whole object, or None. Why through the conditional writer's client once it is there:
        it reads one version in a single GET, where pyarrow's HEAD, then ranged GETs, can join the
        size of one version of a swapped object (the job record, the lease) with the bytes of the next."""
        if self._fallback is False:
            writer = self._writer()
            return self._retry("read", lambda: writer.read(self._bucket_key(name)[1]), name)

        def read() -> bytes | None:
            try:  # why no exists() first: pyarrow opens with a HEAD + GET already; exists() was a third request
                with self.fs.open_input_stream(self.key(name)) as stream:
                    return bytes(stream.read())
            except FileNotFoundError:
                return None

        return self._retry("read", read, name)

    def _put(self, name: str, data: bytes, replace: bool) -> bool:
        """One request writes the whole object. Without `replace`: a conditional put, or in
        single-writer mode check-then-put."""
        if self.guard is not None:
            self.guard()
        if replace:
            self._plain_put(name, data)
            return True
        writer = self.conditional()
        if writer is not None:
            return bool(writer.put_new(self._bucket_key(name)[1], data))
        if self.exists(name):
            return False
        self._plain_put(name, data)
        return True

    def _plain_put(self, name: str, data: bytes) -> None:
        """An unconditional put (idempotent: retried as it is); one request through the store's own
        library where it is installed (pyarrow's stream may split an upload into several)."""
        if missing_library(self.store) is None:
            writer = self._writer()
            self._retry("write", lambda: writer.put(self._bucket_key(name)[1], data), name)
            return

        def put() -> None:
            with self.fs.open_output_stream(self.key(name)) as out:
                out.write(data)

        self._retry("write", put, name)

    def _writer(self) -> Conditional:
        if self._writes is None:
            bucket = self.base.split("/", 1)[0]
            if self.store == "s3":
                client = s3_client(self.options, getattr(self.fs, "region", None))
                self._writes = S3Conditional(client, bucket, self.where, self.policy)
            else:
                self._writes = GcsConditional(gcs_client(self.options), bucket, self.where, self.policy)
        return self._writes

    def _why_not_conditional(self) -> str | None:
        library = missing_library(self.store)
        if library is not None:
            extra = "s3" if self.store == "s3" else "gcs"
            return f"conditional writes need {library}, which is not installed (pip install 'batchgen[{extra}]')"
        return self._writer().refusal(self._bucket_key(f".batchgen.probe-{os.urandom(8).hex()}")[1])

    def _bucket_key(self, name: str) -> tuple[str, str]:
        bucket, _, prefix = self.base.partition("/")
        return bucket, f"{prefix}/{name}" if prefix else name


class Conditional(Protocol):
    """What s3.S3Conditional and gcs.GcsConditional both do."""

    def put(self, key: str, data: bytes) -> None: ...

    def read(self, key: str) -> bytes | None: ...

    def put_new(self, key: str, data: bytes) -> bool: ...

    def swap(self, key: str, data: bytes, expected: bytes) -> bool: ...

    def refusal(self, key: str) -> str | None: ...


def missing_library(store: str) -> str | None:
    """The library conditional writes on `store` ("s3", "gcs") need, when it is not installed."""
    try:
        if store == "s3":
            import boto3  # noqa: F401
        else:
            from google.cloud import storage  # noqa: F401
    except ImportError:
        return "boto3" if store == "s3" else "google-cloud-storage"
    return None
