"""Retries of object-store calls: which errors are transient, and a bounded exponential backoff
with full jitter around every request batchgen sends to a store (reads, lists, part puts, record
swaps, lease renewals).

Why here and not in each client: boto3, pyarrow.fs and google-cloud-storage each retry a little
on their own, differently, silently, and none knows that a conditional put refused on its retry may
be our own first attempt that landed (objectstore_conditional.py settles that). One policy, one
log line per retry naming the URI, one message when the budget is spent.

Why retrying is safe: every write batchgen retries is conditional (a part never replaces one, the
record and the lease are swapped only over the version read) or idempotent (`_SUCCESS` holds the
same totals whoever writes it; a delete of a missing key succeeds).
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from batchgen.errors import StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")

# HTTP statuses and error codes a store answers when trying again later can succeed.
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
_TRANSIENT_CODES = {
    "SlowDown",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "OperationAborted",  # S3: "a conflicting conditional operation is in progress"
    "ConditionalRequestConflict",  # S3 409: another conditional write of the key is in flight
    "RequestTimeTooSkewed",  # a signature computed before a long stall; a fresh one passes
}
# How pyarrow.fs (the AWS and Google C++ SDKs, curl) words the same conditions in an OSError.
_TRANSIENT_TEXT = re.compile(
    r"NETWORK_CONNECTION|curlCode|Connection reset|connection (?:was )?(?:closed|aborted|refused|reset)"
    r"|Couldn't connect|Empty reply|Timeout was reached|timed out|Broken pipe|Recv failure|Send failure"
    r"|SlowDown|RequestTimeout|InternalError|ServiceUnavailable|Service Unavailable|Bad Gateway"
    r"|(?:HTTP status|response code:?|status code:?|Error code:?) ?(?:5\d\d|429)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RetryPolicy:
    """At most `attempts` tries of one call within `seconds`; the n-th wait is drawn uniformly from
    [0, min(cap, base * 2**(n-1))] ("full jitter": many workers hitting one throttled prefix spread
    out instead of retrying in lockstep)."""

    attempts: int = 8
    seconds: float = 120.0
    base: float = 0.25
    cap: float = 20.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The defaults, or BATCHGEN_STORE_ATTEMPTS / BATCHGEN_STORE_RETRY_SECONDS /
        BATCHGEN_STORE_BACKOFF (the first wait's upper bound, seconds) where set."""
        env = os.environ
        try:
            return cls(
                attempts=max(1, int(env.get("BATCHGEN_STORE_ATTEMPTS", cls.attempts))),
                seconds=max(0.0, float(env.get("BATCHGEN_STORE_RETRY_SECONDS", cls.seconds))),
                base=max(0.0, float(env.get("BATCHGEN_STORE_BACKOFF", cls.base))),
            )
        except ValueError as exc:
            raise ValueError(f"BATCHGEN_STORE_ATTEMPTS / _RETRY_SECONDS / _BACKOFF: not a number: {exc}") from None

    def wait(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.cap, self.base * 2 ** (attempt - 1)))


def is_transient(exc: BaseException) -> bool:
    """Whether `exc` from a store call may pass on a retry: a dropped or timed-out connection, a
    5xx, throttling. A refusal (403, no such bucket or key, a failed precondition) is not."""
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if _client_error_is_transient(exc) or _transport_error(exc):
        return True
    if isinstance(exc, OSError):  # pyarrow.fs: the SDK's message is all there is
        return bool(_TRANSIENT_TEXT.search(str(exc)))
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and isinstance(cause, OSError) and is_transient(cause)


def _client_error_is_transient(exc: BaseException) -> bool:
    """A botocore ClientError or a google.api_core error carrying a retryable status or code."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        error = response.get("Error", {})
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return error.get("Code") in _TRANSIENT_CODES or status in _TRANSIENT_STATUS
    code = getattr(exc, "code", None)  # google.api_core.exceptions.GoogleAPICallError
    return type(exc).__module__.startswith("google.") and isinstance(code, int) and code in _TRANSIENT_STATUS


def _transport_error(exc: BaseException) -> bool:
    """botocore's and urllib3's / requests' connection-level errors (no HTTP answer at all)."""
    names = {c.__module__.split(".")[0] + "." + c.__name__ for c in type(exc).__mro__}
    return bool(
        names
        & {
            "botocore.ConnectionError",  # EndpointConnectionError, ConnectTimeoutError, ...
            "botocore.HTTPClientError",  # ConnectionClosedError, ReadTimeoutError, ...
            "botocore.ResponseStreamingError",
            "botocore.IncompleteReadError",
            "urllib3.HTTPError",  # ProtocolError while a body streams in
            "requests.ConnectionError",  # google-cloud-storage's transport
            "requests.Timeout",
            "requests.ChunkedEncodingError",
            "google.TransportError",  # google.auth refreshing a token
        }
    )


def with_retries(call: Callable[[], T], uri: str, what: str, policy: RetryPolicy) -> T:
    """`call()`, tried again after each transient error while the policy allows; StoreUnavailable
    (naming `uri` and the last error) once it does not. Any other error is raised at once."""
    start, attempt = time.monotonic(), 1
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            elapsed, pause = time.monotonic() - start, policy.wait(attempt)
            if attempt >= policy.attempts or elapsed + pause > policy.seconds:
                raise StoreUnavailable(
                    f"{uri}: {what} failed {attempt} time(s) in {elapsed:.1f}s on transient store errors "
                    f"(last: {_short(exc)}); committed parts are kept, rerun to resume"
                ) from exc
            log.warning(
                "%s: %s failed on attempt %d of %d (%s); retrying in %.2fs",
                uri,
                what,
                attempt,
                policy.attempts,
                _short(exc),
                pause,
            )
            time.sleep(pause)
            attempt += 1


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"
