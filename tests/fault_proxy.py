"""A fault-injecting HTTP proxy for tests: put it in front of an S3 API server (moto) and point a
client's endpoint at it. Stdlib only, one thread per connection.

Each request either passes, or (as the plan draws) meets one fault:
  drop   - the connection is closed before the request is forwarded (nothing happened)
  reset  - the same with a TCP reset
  500    - an S3 InternalError answer, not forwarded
  503    - an S3 SlowDown answer, not forwarded
  delay  - forwarded after a pause (slow network, nothing lost)
  cut    - forwarded and answered upstream (a write HAS happened), then the connection is closed
           before the client sees the answer: the case a retry must recognise as its own write
The plan is seeded (reproducible), never faults the same request twice in a row (so a client that
retries always gets through), and stops after `budget` faults.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

KINDS = ("drop", "reset", "500", "503", "delay", "cut")
_ERRORS = {
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "503": (503, "SlowDown", "Please reduce your request rate."),
}


class FaultPlan:
    def __init__(self, seed: int, rate: float, budget: int, delay: float = 0.2) -> None:
        self.rng = random.Random(seed)
        self.rate, self.budget, self.delay = rate, budget, delay
        self.counts: Counter[str] = Counter()
        self.writes_cut: list[str] = []  # "METHOD path" of requests forwarded whose answer was lost
        self._last: dict[str, bool] = {}
        self._lock = threading.Lock()

    def draw(self, method: str, path: str) -> str | None:
        """The fault for this request, or None."""
        key = f"{method} {path}"
        with self._lock:
            faulted_before = self._last.get(key, False)
            fault = None
            if not faulted_before and sum(self.counts.values()) < self.budget and self.rng.random() < self.rate:
                fault = KINDS[self.rng.randrange(len(KINDS))]
                self.counts[fault] += 1
            self._last[key] = fault is not None
            return fault

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class FaultProxy:
    """Listens on 127.0.0.1:<free port>, forwards to `upstream` ("host", port) by `plan`."""

    def __init__(self, upstream: tuple[str, int], plan: FaultPlan) -> None:
        self.plan = plan
        handler = type("Handler", (_Handler,), {"upstream": upstream, "plan": plan})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (it gave up on a slow answer, or read only a range): not our fault."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the SDKs use it
    upstream: tuple[str, int]
    plan: FaultPlan

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def do_GET(self) -> None:
        self._proxy()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _proxy(self) -> None:
        body = self._read_body()
        fault = self.plan.draw(self.command, self.path.split("?", 1)[0])
        if fault in ("drop", "reset"):
            self._hang_up(reset=fault == "reset")
            return
        if fault in _ERRORS:
            self._answer_error(*_ERRORS[fault])
            return
        if fault == "delay":
            time.sleep(self.plan.delay)
        status, reason, headers, payload = self._forward(body)
        if fault == "cut":
            with self.plan._lock:
                self.plan.writes_cut.append(f"{self.command} {self.path}")
            self._hang_up(reset=False)
            return
        self.send_response_only(status, reason)
        for name, value in headers:
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        length = dict((k.lower(), v) for k, v in headers).get("content-length", "0")
        self.send_header("Content-Length", length if self.command == "HEAD" else str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
                if size == 0:
                    while self.rfile.readline().strip():  # trailers (aws-chunked checksums)
                        pass
                    return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            skip = ("transfer-encoding", "content-length", "connection")
            headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            answer = conn.getresponse()
            return answer.status, answer.reason, answer.getheaders(), answer.read()
        finally:
            conn.close()

    def _answer_error(self, status: int, code: str, message: str) -> None:
        xml = f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'
        data = xml.encode()
        self.send_response_only(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _hang_up(self, reset: bool) -> None:
        """Close the client's connection now, without an answer. Why the files first: the socket's
        descriptor stays open while rfile / wfile hold it, and the client would wait for a timeout."""
        self.close_connection = True
        if reset:  # SO_LINGER 0: close() sends RST instead of FIN
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            self.connection.shutdown(socket.SHUT_RDWR)
        self.rfile.close()
        self.wfile.close()
        self.connection.close()
