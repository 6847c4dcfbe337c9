"""The run lock on an object store (batchgen/outputs/lease.py) against a real S3 API (moto): a second run
is refused with exit 7 as on a local folder, shard runs share the lease but not with a plain run,
a killed or expired holder does not block the next run, the lease is renewed while its run lives,
a run that lost its lease writes nothing more, and `--overwrite` deletes nothing under another
run's live lease."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.errors import LockedError
from batchgen.inputs.sharding import ShardSpec
from batchgen.outputs.lease import LEASE_NAME, ObjectLease
from batchgen.outputs.state import OutputLock
from batchgen.storage.base import Storage
from batchgen.storage.open import open_storage
from tests.conftest import make_job, write_job, write_parquet
from tests.s3_server import moto_s3, options


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    with moto_s3() as server:
        yield server


# Why the "lock-" prefix: moto's state is one per process, shared by every test module's server.
def _store(s3: dict[str, Any], name: str) -> Storage:
    return open_storage(f"s3://outputs/lock-{name}", options(s3))


def _lease(s3: dict[str, Any], name: str) -> dict[str, Any]:
    with s3["fs"].open_input_stream(f"outputs/lock-{name}/{LEASE_NAME}") as stream:
        data: dict[str, Any] = json.loads(stream.read())
    return data["holders"]


def _job(tmp_path: Path, model: Path, s3: dict[str, Any], name: str) -> Path:
    data = write_parquet(tmp_path / "in.parquet", {"prompt": ["once upon a time", "the cat", "a dog played"]})
    job = make_job(model, str(data), Path("unused"), engine={"window_rows": 2}, sampling={"max_tokens": 3})
    job["input"]["id_column"] = None
    job["output"] = {"path": f"s3://outputs/lock-{name}", "storage_options": options(s3)}
    return write_job(tmp_path / "job.yaml", job)


def test_a_second_run_is_refused_with_exit_7_naming_the_holder(
    tmp_path: Path, tiny_model_dir: Path, s3: dict[str, Any]
) -> None:
    job = _job(tmp_path, tiny_model_dir, s3, "second")
    holder = OutputLock(_store(s3, "second"))
    holder.acquire()
    try:
        result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    finally:
        holder.release()
    assert result.exit_code == 7, result.output
    assert "s3://outputs/lock-second: another run is writing this output (a run: pid" in result.stderr
    assert _lease(s3, "second") == {}  # released: the entry is gone
    assert CliRunner().invoke(main, ["run", str(job), "--quiet"]).exit_code == 0


def test_shards_share_the_lease_but_never_with_a_plain_run(s3: dict[str, Any]) -> None:
    store = _store(s3, "shards")
    one, two = OutputLock(store, ShardSpec(0, 2)), OutputLock(store, ShardSpec(1, 2))
    one.acquire()
    two.acquire()
    finalize = OutputLock(store, shared=True)
    finalize.acquire()  # beside shard runs, as a flock held shared
    try:
        with pytest.raises(LockedError, match=r"another run is writing this output \(shard 0/2: pid"):
            OutputLock(store, ShardSpec(0, 2)).acquire()
        with pytest.raises(LockedError, match=r"finalize: .*; shard 0/2: .*; shard 1/2: "):
            OutputLock(store).acquire()
    finally:
        for lock in (finalize, two, one):
            lock.release()
    plain = OutputLock(store)
    plain.acquire()
    try:
        with pytest.raises(LockedError, match=r"\(a run: pid"):
            OutputLock(store, ShardSpec(1, 2)).acquire()
    finally:
        plain.release()


def _write_holder(s3: dict[str, Any], name: str, **holder: Any) -> None:
    entry = {"kind": "run", "shard": None, "pid": 1, "host": "elsewhere", "pidns": None, "since": "then"}
    with s3["fs"].open_output_stream(f"outputs/lock-{name}/{LEASE_NAME}") as out:
        out.write(json.dumps({"holders": {"old": {**entry, **holder}}}).encode())


def test_an_expired_or_dead_holder_does_not_block_the_next_run(s3: dict[str, Any]) -> None:
    import os
    import socket

    store = _store(s3, "stale")
    _write_holder(s3, "stale", expires=time.time() + 600)  # live, on another machine
    with pytest.raises(LockedError, match="pid 1 on elsewhere since then, lease 600s left"):
        OutputLock(store).acquire()
    _write_holder(s3, "stale", expires=time.time() - 1)  # its lease ran out: taken over
    lock = OutputLock(store)
    lock.acquire()
    lock.release()
    pid = _exited_pid()  # a process of this host that has exited
    ns = os.readlink("/proc/self/ns/pid")
    _write_holder(s3, "stale", expires=time.time() + 600, host=socket.gethostname(), pidns=ns, pid=pid)
    lock = OutputLock(store)
    lock.acquire()  # kill -9 on this host: no need to wait out the lease
    assert next(iter(_lease(s3, "stale").values()))["pid"] == os.getpid()
    lock.release()


def _exited_pid() -> int:
    import subprocess

    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_lease_is_renewed_while_the_run_lives(s3: dict[str, Any]) -> None:
    store = _store(s3, "renew")
    lease = ObjectLease(store, None, shared=False, seconds=1.5)
    lease.acquire()
    try:
        first = _lease(s3, "renew")[lease.token]["expires"]
        lease.renewed.clear()
        assert lease.renewed.wait(timeout=30)  # the thread renews every half second
        assert _lease(s3, "renew")[lease.token]["expires"] > first
        assert lease.lost is None
    finally:
        lease.release()


def test_a_run_that_lost_its_lease_writes_nothing_more(s3: dict[str, Any]) -> None:
    store = _store(s3, "lost")
    lock = OutputLock(store)
    lock.acquire()
    try:
        _write_holder(s3, "lost", expires=time.time() + 600)  # another run took over after ours expired
        assert lock.lease is not None
        lock.lease.renew()
        with pytest.raises(LockedError, match=r"lost the output.s lease \(its entry was removed"):
            store.write_text("_SUCCESS", "{}", "success_temp_write")
        with pytest.raises(LockedError):
            store.delete("part-000000.parquet")
    finally:
        lock.release()
    assert list(_lease(s3, "lost")) == ["old"]  # the other run's entry is left alone


def test_overwrite_deletes_nothing_under_another_runs_lease(
    tmp_path: Path, tiny_model_dir: Path, s3: dict[str, Any]
) -> None:
    job = _job(tmp_path, tiny_model_dir, s3, "overwrite")
    first = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert first.exit_code == 0, first.output
    selector = pafs.FileSelector("outputs/lock-overwrite")
    before = sorted(i.path for i in s3["fs"].get_file_info(selector))
    shard = OutputLock(_store(s3, "overwrite"), ShardSpec(0, 3))  # a shard run of another job, still going
    shard.acquire()
    try:
        args = ["run", str(job), "--quiet", "--overwrite", "--set", "sampling.max_tokens=2"]
        result = CliRunner().invoke(main, args)
    finally:
        shard.release()
    assert result.exit_code == 7 and "shard 0/3: pid" in result.stderr, result.output
    assert sorted(i.path for i in s3["fs"].get_file_info(selector)) == before
