"""Static shards (`run --shard I/N`, `finalize`) and the Airflow example's commands: N concurrent
processes, one killed and retried, give exactly a plain run's output; parts are global, so N may
change; duplicate ids are judged over the whole job; locks keep shards apart from a plain run."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.errors import LockedError
from batchgen.inputs.sharding import ShardSpec
from batchgen.outputs.parts import PartWriter
from batchgen.outputs.state import OutputLock, OutputState
from batchgen.storage.base import temp_name
from tests.conftest import make_job, write_job, write_parquet

ROWS = 36  # window 4: 9 parts, 3 per shard of 3
WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
BLOCK = 16  # engine.block_size, set in the job: the prefix cache shares whole blocks of this many tokens
PREAMBLE = " ".join(WORDS * 4)  # 40 words, more than two blocks' tokens: shared by every prompt
# Every column but cached_tokens equals a plain run's under shards (README, "cached_tokens under
# shards and resume"): prefix-cache hits depend on which parts ran before in the same process.
SAME = ["id", "generated_text", "finish_reason", "error_code", "input_tokens", "output_tokens"]
DAG = Path(__file__).resolve().parent.parent / "examples" / "airflow" / "batchgen_dag.py"


def _dag() -> ModuleType:
    spec = importlib.util.spec_from_file_location("batchgen_dag", DAG)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job(tmp_path: Path, model: Path, name: str, ids: list[str] | None = None) -> tuple[Path, Path]:
    ids = ids or [f"r{i}" for i in range(ROWS)]
    prompts = [f"{PREAMBLE} {' '.join(WORDS[(i + j) % 10] for j in range(2 + i % 7))}" for i in range(len(ids))]
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(data, {"id": ids, "prompt": prompts})
    out = tmp_path / name
    engine = {"backend": "native", "window_rows": 4, "block_size": BLOCK}
    # why grouping none: these tests are about the p % N rule of parts in input order (prefix
    # groups' shards: tests/test_prefix_groups.py)
    job = make_job(model, str(data), out, engine=engine, input={"grouping": "none"}, sampling={"max_tokens": 6})
    return write_job(tmp_path / f"{name}.yaml", job), out


def _env(fault: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_FAULT")}
    env["OMP_NUM_THREADS"] = "1"  # three processes share two cores
    if fault:
        env["BATCHGEN_FAULT"] = fault
    return env


def _rows(out: Path) -> list[tuple[object, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=SAME)
    return sorted(zip(*(table.column(c).to_pylist() for c in SAME)), key=repr)  # repr: a null beside text


def _cached(out: Path) -> dict[str, int]:
    """cached_tokens by row id (ids are unique in these jobs)."""
    table = ds.dataset(out, format="parquet").to_table(columns=["id", "cached_tokens"])
    return dict(zip(table.column("id").to_pylist(), table.column("cached_tokens").to_pylist()))


def _check_cached(sharded: Path, plain: Path) -> None:
    """What honestly holds for cached_tokens: the prefix cache really serves whole shared blocks in
    both runs; a shard process has seen a subset of the parts the plain run's process had seen
    before each part (no eviction in this tiny job), so its rows reuse no more than the plain run's;
    the plain process computes the preamble's blocks once, each of the N shard processes once."""
    shard_rows, plain_rows = _cached(sharded), _cached(plain)
    assert sum(plain_rows.values()) > 0 and sum(shard_rows.values()) > 0
    assert all(c % BLOCK == 0 for c in [*shard_rows.values(), *plain_rows.values()])  # whole blocks only
    assert all(shard_rows[i] <= plain_rows[i] for i in plain_rows)
    assert sum(shard_rows.values()) < sum(plain_rows.values())


class Plain(NamedTuple):
    """The plain (unsharded) run: its rows (SAME columns), its manifest, its output folder."""

    rows: list[tuple[object, ...]]
    manifest: dict[str, Any]
    out: Path


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Plain:
    tmp = tmp_path_factory.mktemp("plain")
    job, out = _job(tmp, tiny_model_dir, "out")
    _dag().run_command([sys.executable, "-m", "batchgen", "run", str(job), "--quiet"], env=_env())
    return Plain(_rows(out), json.loads((out / "_SUCCESS").read_text()), out)


@pytest.mark.slow
def test_the_dags_commands_with_a_killed_shard_equal_a_plain_run(
    tmp_path: Path, tiny_model_dir: Path, reference: Plain
) -> None:
    dag = _dag()
    job, out = _job(tmp_path, tiny_model_dir, "out")
    commands = dag.shard_commands(str(job), str(out), 3, batchgen=[sys.executable, "-m", "batchgen"])
    # shard 1 is killed (SIGKILL, as by the OOM killer) in its second part, after one commit
    procs = [
        subprocess.Popen(argv, env=_env("mid_engine:6" if i == 1 else None), stdout=subprocess.PIPE, text=True)
        for i, argv in enumerate(commands["shards"])
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes[0] == codes[2] == 0 and codes[1] == -9 and dag.is_retryable(codes[1])
    assert not (out / "_SUCCESS").exists()  # shard 1's parts are missing
    with pytest.raises(dag.CommandFailed) as refused:
        dag.run_command(commands["finalize"], env=_env())
    assert refused.value.returncode == 8 and not refused.value.retryable and "part-000004" in str(refused.value)
    retried = dag.run_command(commands["shards"][1], env=_env())  # the retry resumes
    assert "resumed: 1 part(s) kept" in retried and "_SUCCESS written" in retried
    assert "already finalized" in dag.run_command(commands["finalize"], env=_env())
    report = json.loads(dag.run_command(commands["report"], env=_env()))
    manifest = reference.manifest
    assert _rows(out) == reference.rows  # every row once, the same texts, finish reasons and token counts
    _check_cached(out, reference.out)
    done = json.loads((out / "_SUCCESS").read_text())
    for key in ("rows", "finish_reasons", "error_codes", "parts", "fingerprint"):
        assert done[key] == manifest[key], key
    for key in ("input", "output"):
        assert done["tokens"][key] == manifest["tokens"][key], key
    assert done["tokens"]["cached"] == sum(_cached(out).values())  # what this output's processes reused
    assert report["totals"]["output_tokens"] == manifest["tokens"]["output"]


@pytest.mark.slow
def test_shards_finishing_together_write_one_consistent_success(
    tmp_path: Path, tiny_model_dir: Path, reference: Plain
) -> None:
    dag = _dag()
    job, out = _job(tmp_path, tiny_model_dir, "out")
    commands = dag.shard_commands(str(job), str(out), 3, batchgen=[sys.executable, "-m", "batchgen"])
    procs = [subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, text=True) for argv in commands["shards"]]
    lines = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], lines
    assert any("_SUCCESS written" in line for line in lines)
    assert "already finalized" in dag.run_command(commands["finalize"], env=_env())
    dag.run_command(commands["report"], env=_env())  # exits 3 if _SUCCESS disagreed with the parts
    assert _rows(out) == reference.rows
    _check_cached(out, reference.out)
    assert not list(out.glob(".*.tmp"))


def test_changing_the_number_of_shards_between_runs_completes_the_job(
    tmp_path: Path, tiny_model_dir: Path, reference: Plain
) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out")
    runner = CliRunner()
    first = runner.invoke(main, ["run", str(job), "--shard", "0/2", "--quiet"])
    assert first.exit_code == 0, first.output
    assert "job: 5 of 9 parts committed" in first.output and not (out / "_SUCCESS").exists()
    for i in range(3):  # parts 0 and 6 (shard 0 of 3) were committed by 0/2 already: kept
        result = runner.invoke(main, ["run", str(job), "--shard", f"{i}/3", "--quiet"])
        assert result.exit_code == 0, result.output
    assert "_SUCCESS written" in result.output
    assert _rows(out) == reference.rows
    assert json.loads((out / "_SUCCESS").read_text())["rows"] == reference.manifest["rows"]


def test_a_duplicate_id_is_judged_over_the_whole_job_whichever_shard_runs_first(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    ids = [f"r{i}" for i in range(12)]
    ids[5] = ids[9] = "r0"  # first used in part 0 (shard 0 of 2); later in parts 1 and 2
    job, out = _job(tmp_path, tiny_model_dir, "out", ids)
    runner = CliRunner()
    for shard in ("1/2", "0/2"):  # the later occurrence's shard runs first
        result = runner.invoke(main, ["run", str(job), "--shard", shard, "--quiet"])
        assert result.exit_code == 0, result.output
    table = ds.dataset(out, format="parquet").to_table().sort_by("id").to_pylist()
    codes = [(r["id"], r["error_code"]) for r in table if r["id"] == "r0"]
    assert sorted(codes, key=str) == [("r0", "duplicate_id"), ("r0", "duplicate_id"), ("r0", None)]
    served = [r for r in ds.dataset(out, format="parquet").to_table().to_pylist() if r["id"] == "r0"]
    assert [r["error_code"] for r in served] == [None, "duplicate_id", "duplicate_id"]  # parts in order


@pytest.mark.parametrize(
    ("value", "message"),
    [("4/4", "I must be below N"), ("0/0", "at least 1"), ("1-4", "not I/N"), ("-1/4", "not I/N")],
)
def test_a_bad_shard_is_a_usage_error(tmp_path: Path, value: str, message: str) -> None:
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--shard", value])
    assert result.exit_code == 2 and message in result.output


def test_overwrite_with_a_shard_is_refused(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["run", str(tmp_path / "job.yaml"), "--shard", "0/2", "--overwrite"])
    assert result.exit_code == 2 and "--overwrite cannot be combined with --shard" in result.output


def test_a_shard_with_nothing_to_do_exits_0(tmp_path: Path, tiny_model_dir: Path) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out", [f"r{i}" for i in range(8)])  # 2 parts
    result = CliRunner().invoke(main, ["run", str(job), "--shard", "5/8", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "shard 5/8: 0 rows ok" in result.output and "0 of 2 parts committed" in result.output
    assert not list(out.glob("part-*"))


def test_a_second_run_of_one_shard_is_refused_and_shards_exclude_a_plain_run(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out")
    out.mkdir()
    held = OutputLock(out, ShardSpec(1, 4))
    held.acquire()
    try:
        result = CliRunner().invoke(main, ["run", str(job), "--shard", "1/4", "--quiet"])
        assert result.exit_code == 7 and "another run of shard 1/4" in result.output
        beside = OutputLock(out, ShardSpec(2, 4))
        beside.acquire()  # another shard may run beside it
        beside.release()
        with pytest.raises(LockedError, match="shard runs"):
            OutputLock(out).acquire()  # a plain run may not
    finally:
        held.release()
    plain = OutputLock(out)
    plain.acquire()
    try:
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
            OutputLock(out, ShardSpec(0, 4)).acquire()
        with pytest.raises(LockedError):
            OutputLock(out, shared=True).acquire()  # finalize waits for the plain run too
    finally:
        plain.release()


def test_finalize_names_missing_parts_then_writes_success_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out", [f"r{i}" for i in range(28)])  # 7 parts
    runner = CliRunner()
    assert runner.invoke(main, ["run", str(job), "--shard", "0/7", "--quiet"]).exit_code == 0
    refused = runner.invoke(main, ["finalize", str(out)])
    assert refused.exit_code == 8
    assert "6 of 7 parts not committed yet: part-000001.parquet" in refused.output and "and 1 more" in refused.output
    assert runner.invoke(main, ["run", str(job), "--quiet"]).exit_code == 0  # a plain run finishes the rest
    (out / "_SUCCESS").unlink()  # as if the last shard died before writing it
    done = runner.invoke(main, ["finalize", str(out)])
    assert done.exit_code == 0 and "finalized: 7 parts, 28 rows ok" in done.output
    again = runner.invoke(main, ["finalize", str(out)])
    assert again.exit_code == 0 and "already finalized" in again.output
    report = runner.invoke(main, ["report", str(out), "--json"])
    assert report.exit_code == 0, report.output  # the manifest's totals match the parts


def test_finalize_outside_an_output_is_bad_input(tmp_path: Path) -> None:
    assert CliRunner().invoke(main, ["finalize", str(tmp_path / "nope")]).exit_code == 3
    assert CliRunner().invoke(main, ["finalize", str(tmp_path)]).exit_code == 3


def test_a_committed_part_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "_JOB.json").write_text('{"id": "x"}')  # a run has claimed the output
    writer = PartWriter(tmp_path, pa.schema([("x", pa.int64())]))
    first = writer.write_part(0, pa.table({"x": [1]}))
    assert first is not None and not writer.write_part(0, pa.table({"x": [2]}))
    assert ds.dataset(tmp_path, format="parquet").to_table().column("x").to_pylist() == [1]
    assert not list(tmp_path.glob(".*.tmp"))
    # both writers described their bytes before committing; the part that landed matches one of them
    described = json.loads((tmp_path / "_JOB.json").read_text())["part_checks"]["part-000000.parquet"]
    assert first.as_json() in described and len(described) == 2
    assert hashlib.sha256((tmp_path / "part-000000.parquet").read_bytes()).hexdigest() == first.sha256


def test_a_shard_removes_only_its_own_parts_temp_files(tmp_path: Path) -> None:
    names = [temp_name("part-000001.parquet"), temp_name("part-000002.parquet"), temp_name("_JOB.json")]
    for name in names:
        (tmp_path / name).write_text("")
    assert OutputState(tmp_path).remove_leftovers(ShardSpec(1, 2).owns) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


def test_shards_claiming_the_record_keep_the_first(tmp_path: Path) -> None:
    first = {"id": "a", "settings": {}, "model": "m", "inputs": {}, "run": {"parts": 1, "started": time.time()}}
    runs = [OutputState(tmp_path), OutputState(tmp_path)]  # two shard runs of one job, starting at once
    assert not any(run.check_record(first) for run in runs)
    runs[0].claim_record(first, refresh=False)
    runs[1].claim_record({**first, "run": {"parts": 1, "started": 0.0}}, refresh=False)
    assert runs[1].read_record() == first
