"""Conditional writes on Google Cloud Storage, sent with google-cloud-storage (pyarrow.fs's
GcsFileSystem sends no precondition).

The same two primitives as s3.py, with generation preconditions: put a key only if it
does not exist (`ifGenerationMatch=0`), replace a key only if it is the very generation read
(`ifGenerationMatch=<generation>`). The library's own retries are off (`retry=None`): RetryPolicy
retries, logs and bounds every call, and a refusal met on a retry is checked against the
object's content (our own earlier attempt may have landed while its answer was lost).

Not exercised against a real GCS API in the tests (no emulator on PyPI honours generation
preconditions); the contract is tested through S3 and the local store.
"""

from __future__ import annotations

from typing import Any, NoReturn

from batchgen.storage.retry import RetryPolicy, is_transient, with_retries

_BINARY = "application/octet-stream"


class GcsConditional:
    """put_new / swap / refusal on one bucket, for ObjectStorage (the same contract as S3Conditional)."""

    def __init__(self, client: Any, bucket: str, where: str, policy: RetryPolicy) -> None:
        self.bucket = client.bucket(bucket)
        self.name, self.where, self.policy = bucket, where, policy

    def put(self, key: str, data: bytes) -> None:
        """An unconditional upload, tried once (the caller retries: it is idempotent)."""
        try:
            self.bucket.blob(key).upload_from_string(data, _BINARY, retry=None)
        except Exception as exc:
            _raise_named(exc, self.where, key)

    def put_new(self, key: str, data: bytes) -> bool:
        def attempt() -> bool:
            try:
                self.bucket.blob(key).upload_from_string(data, _BINARY, if_generation_match=0, retry=None)
                return True
            except Exception as exc:
                if _status(exc) != 412:
                    _raise_named(exc, self.where, key)
            return self.holds(key, data)

        return with_retries(attempt, self._uri(key), "conditional put", self.policy)

    def swap(self, key: str, data: bytes, expected: bytes) -> bool:
        def attempt() -> bool:
            current = self._get(key)
            if current is None:
                return False
            body, generation = current
            if body == data:  # an earlier attempt landed, its answer lost (or the same text: no-op)
                return True
            if body != expected:
                return False
            try:
                self.bucket.blob(key).upload_from_string(data, _BINARY, if_generation_match=generation, retry=None)
                return True
            except Exception as exc:
                if _status(exc) != 412:
                    _raise_named(exc, self.where, key)
            return self.holds(key, data)

        return with_retries(attempt, self._uri(key), "conditional swap", self.policy)

    def holds(self, key: str, data: bytes) -> bool:
        current = self._get(key)
        return current is not None and current[0] == data

    def refusal(self, key: str) -> str | None:
        """Why this bucket cannot be trusted with conditional writes (probed on `key`), or None."""
        try:
            if not self.put_new(key, b"1"):
                return f"{self._uri(key)}: a fresh probe key already exists"
            if self.put_new(key, b"2"):
                return "the store ignores ifGenerationMatch=0 (a conditional upload replaced an object)"
            current = with_retries(lambda: self._get(key), self._uri(key), "probe", self.policy)
            wrong = (current[1] if current else 0) + 1  # a generation the object has not got
            if with_retries(lambda: self._put_on_wrong_generation(key, wrong), self._uri(key), "probe", self.policy):
                return None
            return "the store ignores ifGenerationMatch (an upload on a wrong generation replaced the object)"
        finally:
            with_retries(lambda: self._delete(key), self._uri(key), "delete", self.policy)

    def _put_on_wrong_generation(self, key: str, wrong: int) -> bool:
        """Whether an upload conditional on a generation the object does not have is refused (412)."""
        try:
            self.bucket.blob(key).upload_from_string(b"3", _BINARY, if_generation_match=wrong, retry=None)
        except Exception as exc:
            if _status(exc) == 412:
                return True
            _raise_named(exc, self.where, key)
        return False

    def read(self, key: str) -> bytes | None:
        """One version of `key`, whole (one request), or None when there is none."""
        got = self._get(key)
        return None if got is None else got[0]

    def _get(self, key: str) -> tuple[bytes, int] | None:
        """(content, generation) of one generation of `key`; None when there is none."""
        try:
            blob = self.bucket.get_blob(key, retry=None)
            if blob is None:
                return None
            return blob.download_as_bytes(if_generation_match=blob.generation, retry=None), int(blob.generation)
        except Exception as exc:
            if _status(exc) in (404, 412):  # deleted or replaced between the two requests: read again
                return None if _status(exc) == 404 else self._get(key)
            _raise_named(exc, self.where, key)

    def _delete(self, key: str) -> None:
        try:
            self.bucket.blob(key).delete(retry=None)
        except Exception as exc:
            if _status(exc) != 404:
                _raise_named(exc, self.where, key)

    def _uri(self, key: str) -> str:
        return f"gs://{self.name}/{key}"


def _status(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)  # google.api_core.exceptions.GoogleAPICallError
    return code if isinstance(code, int) else None


def _raise_named(exc: Exception, where: str, key: str) -> NoReturn:
    """A store refusal as an OSError naming the object; a transient error unchanged (it is retried)."""
    if is_transient(exc):
        raise exc
    raise OSError(f"{where}: gcs object {key}: {exc}") from exc


def gcs_client(options: dict[str, Any]) -> Any:
    """A google-cloud-storage client for the options the pyarrow one got; None without the library.
    Credentials: the application default ones, as pyarrow's GcsFileSystem finds them."""
    try:
        from google.cloud import storage
    except ImportError:
        return None
    client_options = None
    if "endpoint_override" in options:
        client_options = {"api_endpoint": f"{options.get('scheme', 'https')}://{options['endpoint_override']}"}
    if options.get("anonymous"):
        return storage.Client.create_anonymous_client()
    return storage.Client(project=options.get("project_id"), client_options=client_options)
