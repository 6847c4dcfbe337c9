"""Conditional writes on S3, sent with boto3 (pyarrow.fs cannot send a precondition, apache/arrow#44281).

Two primitives carry every exactly-once guarantee on S3: put a key only if it does not exist
(`If-None-Match: *`: parts, a first job record, a first lease) and replace a key only if it is the
very object read (`If-Match: <ETag>`: the record and the lease). Each is retried on transient
errors (retry.py); a refusal met on a retry is checked against the object's content, since
it may be our own earlier attempt that landed while its answer was lost.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from batchgen.storage.retry import RetryPolicy, is_transient, with_retries

log = logging.getLogger(__name__)
_MISSING = ("NoSuchKey", "404", "NotFound")


class S3Conditional:
    """put_new / swap / refusal on one bucket, for ObjectStorage (the same contract as GcsConditional)."""

    def __init__(self, client: Any, bucket: str, where: str, policy: RetryPolicy) -> None:
        self.client, self.bucket, self.where, self.policy = client, bucket, where, policy

    def put(self, key: str, data: bytes) -> None:
        """An unconditional put, tried once (the caller retries: it is idempotent)."""
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=data)
        except Exception as exc:
            _raise_named(exc, self.where, key)

    def put_new(self, key: str, data: bytes) -> bool:
        """Write `key` unless it exists; True when it now holds `data` (this write, or an earlier
        attempt of it whose answer was lost), False when another object stands there."""

        def attempt() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
            except Exception as exc:
                if _code(exc) != "PreconditionFailed":
                    _raise_named(exc, self.where, key)
            return self.holds(key, data)

        return with_retries(attempt, self._uri(key), "conditional put", self.policy)

    def swap(self, key: str, data: bytes, expected: bytes) -> bool:
        """Replace `key` by `data` only if it still holds `expected` (If-Match on the ETag of the very
        object compared); True when it now holds `data`, False when it is gone or holds another."""

        def attempt() -> bool:
            current = self._get(key)
            if current is None:
                return False
            body, etag = current
            if body == data:  # an earlier attempt landed, its answer lost (or the same text: no-op)
                return True
            if body != expected:
                return False
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfMatch=etag)
                return True
            except Exception as exc:
                if _code(exc) != "PreconditionFailed":
                    _raise_named(exc, self.where, key)
            return self.holds(key, data)

        return with_retries(attempt, self._uri(key), "conditional swap", self.policy)

    def holds(self, key: str, data: bytes) -> bool:
        current = self._get(key)
        return current is not None and current[0] == data

    def refusal(self, key: str) -> str | None:
        """Why this store cannot be trusted with conditional writes (probed on `key`), or None."""
        try:
            if not self.put_new(key, b"1"):
                return f"{self._uri(key)}: a fresh probe key already exists"
            if self.put_new(key, b"2"):
                return "the store ignores If-None-Match (a conditional put replaced an existing object)"
            answer = with_retries(lambda: self._put_on_wrong_etag(key), self._uri(key), "probe", self.policy)
            if answer == "PreconditionFailed":
                return None
            if answer == "NotImplemented":
                return "the store does not implement If-Match on PutObject (answered 501)"
            return "the store ignores If-Match (a put on a wrong ETag replaced the object)"
        except OSError as exc:
            if "NotImplemented" in str(exc):
                return f"the store does not implement conditional puts ({exc})"
            raise
        finally:
            drop = lambda: self.client.delete_object(Bucket=self.bucket, Key=key)  # noqa: E731
            with_retries(drop, self._uri(key), "delete", self.policy)

    def _put_on_wrong_etag(self, key: str) -> str | None:
        """The error code of a put conditional on an ETag no object has; None when it was written."""
        try:
            self.client.put_object(Bucket=self.bucket, Key=key, Body=b"3", IfMatch='"0"')
        except Exception as exc:
            if _code(exc) in ("PreconditionFailed", "NotImplemented"):
                return _code(exc)
            _raise_named(exc, self.where, key)
        return None

    def read(self, key: str) -> bytes | None:
        """One version of `key`, whole (one request), or None when there is none."""
        got = self._get(key)
        return None if got is None else got[0]

    def _get(self, key: str) -> tuple[bytes, str] | None:
        try:
            got = self.client.get_object(Bucket=self.bucket, Key=key)
            return got["Body"].read(), got["ETag"]
        except Exception as exc:
            if _code(exc) in _MISSING:
                return None
            _raise_named(exc, self.where, key)

    def _uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"


def _code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _raise_named(exc: Exception, where: str, key: str) -> NoReturn:
    """A store refusal as an OSError naming the object; a transient error unchanged (it is retried)."""
    if is_transient(exc):
        raise exc
    raise OSError(f"{where}: s3 object {key}: {exc}") from exc


def s3_client(options: dict[str, Any], region: str | None) -> Any:
    """A boto3 S3 client with the same endpoint, region and credentials as the pyarrow one; None
    without boto3. botocore's own retries are off: RetryPolicy retries, logs and bounds every call."""
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        return None
    config: dict[str, Any] = {"retries": {"total_max_attempts": 1}}
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
