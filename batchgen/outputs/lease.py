"""The run lock on an object store: a lease object, `.batchgen.lock` under the output prefix.

An object store has no flock, and nothing releases a lock when its holder dies, so the lock is a
lease: a small JSON object naming its holders, each with an expiry time. A run claims it with a
conditional write (a first lease: put if absent; later: a swap over the very version read, so of
two runs claiming at once one wins and the other reads again), renews its own entry from a
background thread while it lives, and removes it when it ends. A holder whose entry has expired
(killed, its machine gone, cut off from the store) no longer counts: the next run drops it in
the same conditional swap. On the holder's own host a holder whose process is gone is dropped at
once, so a cron rerun after kill -9 need not wait out the lease.

The same rules as the local flocks (state.OutputLock): a plain run holds it alone; shard runs
and `finalize` share it, never beside a plain run; two runs of one shard exclude each other.
Expiry compares the holder's clock with the reader's: keep clocks in sync (NTP), as any lease does.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from typing import Any

from batchgen.errors import LockedError, OutputError
from batchgen.storage.base import Storage

log = logging.getLogger(__name__)
LEASE_NAME = ".batchgen.lock"
DEFAULT_SECONDS = 90.0  # a holder not renewed for this long is gone
_CLAIM_ROUNDS = 50  # reads and swaps lost to other claimers before giving up


def lease_seconds() -> float:
    """The lease's lifetime: BATCHGEN_LEASE_SECONDS, else DEFAULT_SECONDS; renewed every third of it."""
    text = os.environ.get("BATCHGEN_LEASE_SECONDS")
    try:
        return max(1.0, float(text)) if text else DEFAULT_SECONDS
    except ValueError:
        raise OutputError(f"BATCHGEN_LEASE_SECONDS={text!r}: not a number of seconds") from None


class ObjectLease:
    """One run's entry in the lease object: claim, renew (in a thread), release."""

    def __init__(self, storage: Storage, shard: str | None, shared: bool, seconds: float | None = None) -> None:
        self.storage = storage
        self.shard = shard  # "I/N" for a shard run
        self.kind = "shard" if shard is not None else "shared" if shared else "run"
        self.seconds = seconds or lease_seconds()
        self.token = uuid.uuid4().hex
        self.lost: str | None = None  # why this run no longer holds the lease
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.renewed = threading.Event()  # set after each renewal (tests wait on it)

    def acquire(self) -> None:
        def claim(holders: dict[str, Any]) -> dict[str, Any]:
            blocking = [h for h in holders.values() if self._conflicts(h)]
            if blocking:
                raise LockedError(f"{self.storage.where}: another run is writing this output ({_describe(blocking)})")
            return {**holders, self.token: self._entry()}

        self._update(claim)
        self._thread = threading.Thread(target=self._renew_loop, name="batchgen-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.lost is None:
            try:
                self._update(lambda holders: {k: v for k, v in holders.items() if k != self.token})
            except OSError as exc:  # it expires on its own
                log.warning(
                    "%s: could not remove this run's lease entry (%s); it expires by itself", self._where(), exc
                )

    def check(self) -> None:
        """LockedError when this run has lost its lease (another run took it over after it
        expired): nothing more may be written."""
        if self.lost is not None:
            raise LockedError(f"{self.storage.where}: this run lost the output's lease ({self.lost}); it stops here")

    def renew(self) -> None:
        """Push this run's expiry forward; records `lost` when its entry is gone."""

        def extend(holders: dict[str, Any]) -> dict[str, Any]:
            if self.token not in holders:
                raise _Lost("its entry was removed: it had expired and another run took the output over")
            return {**holders, self.token: self._entry()}

        try:
            self._update(extend)
        except _Lost as exc:
            self.lost = str(exc)
            log.error("%s: %s", self._where(), exc)
        self.renewed.set()

    def _renew_loop(self) -> None:
        deadline = time.time() + self.seconds
        while not self._stop.wait(self.seconds / 3):
            try:
                self.renew()
                deadline = time.time() + self.seconds
            except Exception as exc:  # StoreUnavailable, a refusal: try again next round while time is left
                log.warning("%s: lease renewal failed (%s)", self._where(), exc)
                if time.time() > deadline:
                    self.lost = f"not renewed for {self.seconds:.0f}s: {exc}"
            if self.lost is not None:
                return

    def _update(self, change: Any) -> None:
        """Read the lease, apply `change` to its live holders, write it back over the version read."""
        for _ in range(_CLAIM_ROUNDS):
            text = self.storage.read_text(LEASE_NAME)
            holders = {k: v for k, v in _parse(text, self._where()).items() if _alive(v)}
            body = json.dumps({"holders": change(holders)}, indent=1, sort_keys=True)
            if self.storage.swap_text(LEASE_NAME, body, text, "lease_write"):
                return
            time.sleep(random.uniform(0.0, 0.2))  # another run changed it in between: read it again
        raise OutputError(f"{self._where()}: the lease kept changing under {_CLAIM_ROUNDS} attempts to update it")

    def _conflicts(self, holder: dict[str, Any]) -> bool:
        if self.kind == "run" or holder.get("kind") == "run":
            return True
        return self.shard is not None and holder.get("shard") == self.shard

    def _entry(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "shard": self.shard,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "pidns": _pid_namespace(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "expires": time.time() + self.seconds,
        }

    def _where(self) -> str:
        return self.storage.describe(LEASE_NAME)


class _Lost(Exception):
    pass


def _parse(text: str | None, where: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        holders = json.loads(text).get("holders", {})
    except (ValueError, AttributeError) as exc:
        raise OutputError(f"{where}: not a batchgen lease ({exc}); delete it if no run is writing") from exc
    return holders if isinstance(holders, dict) else {}


def _alive(holder: Any) -> bool:
    """Whether a holder still counts: not expired, and not a process of this host known to be gone."""
    if not isinstance(holder, dict) or float(holder.get("expires", 0)) < time.time():
        return False
    same_host = holder.get("host") == socket.gethostname() and holder.get("pidns") == _pid_namespace()
    if not same_host or not isinstance(holder.get("pid"), int) or _pid_namespace() is None:
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, another user's
    return True


def _pid_namespace() -> str | None:
    """This process's pid namespace (Linux): a pid means the same process only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _describe(holders: list[dict[str, Any]]) -> str:
    parts = []
    for h in holders:
        kind = {"run": "a run", "shared": "finalize"}.get(str(h.get("kind")), "a run")
        what = f"shard {h['shard']}" if h.get("shard") else kind
        left = max(0.0, float(h.get("expires", 0)) - time.time())
        parts.append(f"{what}: pid {h.get('pid')} on {h.get('host')} since {h.get('since')}, lease {left:.0f}s left")
    return "; ".join(sorted(parts))
