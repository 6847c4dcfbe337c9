"""Retries of store calls (batchgen/storage/retry.py): which errors are transient, that retries are
bounded and logged, that a permanent error fails at once, and that a conditional put whose answer
was lost recognises its own write on the retry instead of taking it for another writer's."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from batchgen.errors import StoreUnavailable
from batchgen.storage.retry import RetryPolicy, is_transient, with_retries
from batchgen.storage.s3 import S3Conditional

FAST = RetryPolicy(attempts=4, seconds=5.0, base=0.0)


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    answer = {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return ClientError(answer, "PutObject")  # type: ignore[arg-type]


def _transport_errors() -> list[Exception]:
    from botocore.exceptions import ConnectionClosedError, EndpointConnectionError, ReadTimeoutError

    return [
        EndpointConnectionError(endpoint_url="http://x"),
        ConnectionClosedError(endpoint_url="http://x"),
        ReadTimeoutError(endpoint_url="http://x"),
        ConnectionResetError(104, "Connection reset by peer"),
        TimeoutError("read timed out"),
    ]


@pytest.mark.parametrize(
    ("code", "status", "transient"),
    [
        ("SlowDown", 503, True),
        ("InternalError", 500, True),
        ("Whatever", 502, True),
        ("RequestTimeout", 400, True),
        ("AccessDenied", 403, False),
        ("NoSuchBucket", 404, False),
        ("PreconditionFailed", 412, False),
    ],
)
def test_client_errors_are_classified_by_code_and_status(code: str, status: int, transient: bool) -> None:
    assert is_transient(_client_error(code, status)) is transient


def test_transport_errors_are_transient() -> None:
    assert all(is_transient(exc) for exc in _transport_errors())


@pytest.mark.parametrize(
    ("message", "transient"),
    [
        ("When reading information for key 'a' in bucket 'b': AWS Error NETWORK_CONNECTION during HeadObject", True),
        ("AWS Error SLOW_DOWN during PutObject operation: SlowDown", True),
        ("When uploading part: AWS Error UNKNOWN (HTTP status 503) during UploadPart operation", True),
        ("curlCode: 56, Failure when receiving data from the peer", True),
        ("AWS Error ACCESS_DENIED during HeadObject operation: No response body.", False),
        ("Bucket 'b' not found", False),
    ],
)
def test_pyarrow_os_errors_are_classified_by_their_message(message: str, transient: bool) -> None:
    assert is_transient(OSError(message)) is transient
    assert not is_transient(FileNotFoundError(message))  # a missing key is an answer, not a fault


def test_a_transient_error_is_retried_and_each_retry_logged(caplog: pytest.LogCaptureFixture) -> None:
    errors = _transport_errors()
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise errors[len(calls)]
        return "done"

    with caplog.at_level(logging.WARNING):
        assert with_retries(flaky, "s3://b/out/part-000001.parquet", "conditional put", FAST) == "done"
    assert len(calls) == 3
    retries = [r.getMessage() for r in caplog.records]
    assert len(retries) == 2 and all("s3://b/out/part-000001.parquet: conditional put failed" in m for m in retries)
    assert "attempt 1 of 4" in retries[0] and "attempt 2 of 4" in retries[1]


def test_retries_are_bounded_by_attempts_and_time() -> None:
    calls: list[int] = []

    def down() -> None:
        calls.append(1)
        raise _client_error("ServiceUnavailable", 503)

    with pytest.raises(StoreUnavailable, match=r"s3://b/out: list failed 4 time\(s\).*ServiceUnavailable") as info:
        with_retries(down, "s3://b/out", "list", FAST)
    assert len(calls) == 4 and info.value.exit_code == 10
    calls.clear()
    with pytest.raises(StoreUnavailable):
        with_retries(down, "s3://b/out", "list", RetryPolicy(attempts=100, seconds=0.05, base=0.02))
    assert 1 < len(calls) < 100  # the time budget ended it


def test_a_permanent_error_fails_at_once() -> None:
    calls: list[int] = []

    def denied() -> None:
        calls.append(1)
        raise _client_error("AccessDenied", 403)

    with pytest.raises(Exception, match="AccessDenied"):
        with_retries(denied, "s3://b/out", "read", FAST)
    assert calls == [1]


def test_the_policy_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_STORE_ATTEMPTS", "3")
    monkeypatch.setenv("BATCHGEN_STORE_RETRY_SECONDS", "7.5")
    policy = RetryPolicy.from_env()
    assert (policy.attempts, policy.seconds) == (3, 7.5)
    assert all(0 <= policy.wait(n) <= min(policy.cap, policy.base * 2 ** (n - 1)) for n in range(1, 12))


class _FakeS3:
    """put_object / get_object of a one-bucket store with If-None-Match and If-Match, whose answer to
    a successful put can be lost (the write lands, the client sees a dropped connection)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.lose_answers = 0

    def put_object(self, Bucket: str, Key: str, Body: bytes, IfNoneMatch: str = "", IfMatch: str = "") -> Any:
        from botocore.exceptions import ConnectionClosedError

        if (IfNoneMatch and Key in self.objects) or (IfMatch and IfMatch != self._etag(Key)):
            raise _client_error("PreconditionFailed", 412)
        self.objects[Key] = Body
        if self.lose_answers:
            self.lose_answers -= 1
            raise ConnectionClosedError(endpoint_url="http://x")
        return {"ETag": self._etag(Key)}

    def get_object(self, Bucket: str, Key: str) -> Any:
        if Key not in self.objects:
            raise _client_error("NoSuchKey", 404)

        class Body:
            @staticmethod
            def read() -> bytes:
                return self.objects[Key]

        return {"Body": Body, "ETag": self._etag(Key)}

    def _etag(self, key: str) -> str:
        return f'"{hash(self.objects.get(key))}"'


def test_a_put_whose_answer_was_lost_is_recognised_as_our_own_on_the_retry() -> None:
    fake = _FakeS3()
    store = S3Conditional(fake, "b", "s3://b/out", FAST)
    fake.lose_answers = 1
    assert store.put_new("out/part-000000.parquet", b"ours")  # landed; the retry's 412 is our own write
    assert not store.put_new("out/part-000000.parquet", b"theirs")  # another writer's object stands
    assert fake.objects["out/part-000000.parquet"] == b"ours"
    fake.lose_answers = 1
    assert store.swap("out/_JOB.json", b"x", b"y") is False  # nothing there
    fake.objects["out/_JOB.json"] = b"old"
    fake.lose_answers = 1
    assert store.swap("out/_JOB.json", b"new", b"old")  # the retry reads "new": its own write landed
    assert not store.swap("out/_JOB.json", b"newer", b"old")


class _GcsAnswer(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"HTTP {code}")
        self.code = code


class _FakeGcsBucket:
    """The few google-cloud-storage Bucket / Blob calls GcsConditional makes, with generation
    preconditions, and answers that can be lost after an upload landed (no GCS emulator on PyPI
    honours preconditions; this checks our use of the API's shape, not GCS itself)."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.generation = 0
        self.lose_answers = 0

    def bucket(self, name: str) -> _FakeGcsBucket:
        return self

    def blob(self, key: str) -> Any:
        fake = self

        class Blob:
            generation = fake.objects.get(key, (b"", 0))[1]

            def upload_from_string(self, data: bytes, content_type: str, if_generation_match: Any = None, **_: Any):
                current = fake.objects.get(key, (b"", 0))[1]
                if if_generation_match is not None and if_generation_match != current:
                    raise _GcsAnswer(412)
                fake.generation += 1
                fake.objects[key] = (data, fake.generation)
                if fake.lose_answers:
                    fake.lose_answers -= 1
                    raise ConnectionResetError(104, "Connection reset by peer")

            def download_as_bytes(self, if_generation_match: Any = None, **_: Any) -> bytes:
                if key not in fake.objects:
                    raise _GcsAnswer(404)
                if if_generation_match is not None and if_generation_match != fake.objects[key][1]:
                    raise _GcsAnswer(412)
                return fake.objects[key][0]

            def delete(self, **_: Any) -> None:
                if fake.objects.pop(key, None) is None:
                    raise _GcsAnswer(404)

        return Blob()

    def get_blob(self, key: str, **_: Any) -> Any:
        return self.blob(key) if key in self.objects else None


def test_the_gcs_writer_keeps_the_same_contract_with_generation_preconditions() -> None:
    from batchgen.storage.gcs import GcsConditional

    fake = _FakeGcsBucket()
    store = GcsConditional(fake, "b", "gs://b/out", FAST)
    assert store.refusal("out/.probe") is None and "out/.probe" not in fake.objects
    fake.lose_answers = 1
    assert store.put_new("out/part-000000.parquet", b"ours")  # landed, answer lost: recognised as ours
    assert not store.put_new("out/part-000000.parquet", b"theirs")
    assert not store.swap("out/_JOB.json", b"x", b"y")
    assert store.put_new("out/_JOB.json", b"old")
    fake.lose_answers = 1
    assert store.swap("out/_JOB.json", b"new", b"old")
    assert not store.swap("out/_JOB.json", b"newer", b"old")
    assert fake.objects["out/_JOB.json"][0] == b"new" and fake.objects["out/part-000000.parquet"][0] == b"ours"
