"""An Airflow DAG that runs one batchgen job over N mapped tasks (static shards), then
`batchgen finalize`, then `batchgen report --json` (its stdout becomes the task's XCom).

Copy it into your DAGs folder and set JOB, OUTPUT and NUM_SHARDS (or the BATCHGEN_* variables;
BATCHGEN_COMMAND names the batchgen executable, e.g. /opt/batchgen/.venv/bin/batchgen, when batchgen
lives in its own venv beside Airflow's: the tasks only run its command line).
Each mapped task runs `batchgen run JOB --shard I/N --quiet`; give each one its own GPU (a pool,
a queue per worker, or CUDA_VISIBLE_DEVICES in the worker's environment). A task is retried only
when its exit code says a rerun can succeed (RETRYABLE_EXIT_CODES, or killed by a signal such as
the OOM killer's SIGKILL); a bad job file or bad input fails at once. A rerun of a shard resumes
it: its committed parts are kept.

The commands live in plain functions (`shard_commands`, `run_command`) that import nothing from
Airflow, so the tests run exactly these commands without Airflow installed; `make test` also runs
the whole DAG with `airflow dags test` under a real Airflow 3 (tests/test_airflow_dag.py).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Sequence
from datetime import datetime, timedelta

JOB = os.environ.get("BATCHGEN_JOB", "jobs/nightly.yaml")
OUTPUT = os.environ.get("BATCHGEN_OUTPUT", "out/nightly")  # the job's output.path
NUM_SHARDS = int(os.environ.get("BATCHGEN_SHARDS", "4"))
BATCHGEN = shlex.split(os.environ.get("BATCHGEN_COMMAND", "batchgen"))
# 6 engine failure, 7 output locked (e.g. the previous try is still exiting), 9 executor (a job with
# `executor: {kind: ray}` whose cluster did not answer; a retry also meets a missing Ray install, but
# a cluster restarting is the common case), 130/143 SIGINT/SIGTERM, 137 SIGKILL as a shell reports
# it. Everything else (2 bad job, 3 bad input, 4 model, 5 output, 8 finalize before every part is
# committed) needs a person, not a retry.
RETRYABLE_EXIT_CODES = frozenset({6, 7, 9, 10, 130, 137, 143})


def shard_commands(job: str, output: str, num_shards: int, batchgen: Sequence[str] = ("batchgen",)) -> dict:
    """{"shards": [argv per shard], "finalize": argv, "report": argv}: what the DAG runs, in order."""
    prefix = list(batchgen)
    return {
        "shards": [[*prefix, "run", job, "--shard", f"{i}/{num_shards}", "--quiet"] for i in range(num_shards)],
        "finalize": [*prefix, "finalize", output],
        "report": [*prefix, "report", output, "--json"],
    }


def is_retryable(returncode: int) -> bool:
    """A negative code is Python's way of saying a signal killed the process (-9: SIGKILL)."""
    return returncode < 0 or returncode in RETRYABLE_EXIT_CODES


class CommandFailed(Exception):
    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        super().__init__(f"{' '.join(argv)} exited {returncode}: {stderr.strip()[-2000:]}")
        self.returncode = returncode
        self.retryable = is_retryable(returncode)


def run_command(argv: Sequence[str], env: dict[str, str] | None = None) -> str:
    """Run one step; its stdout on success, else CommandFailed saying whether to retry."""
    done = subprocess.run(list(argv), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise CommandFailed(argv, done.returncode, done.stderr)
    return done.stdout


try:  # Airflow 3 (the task SDK) first, then Airflow 2; without Airflow this file is just the functions above
    from airflow.sdk import dag, task
    from airflow.sdk.exceptions import AirflowException, AirflowFailException
except ImportError:
    try:
        from airflow.decorators import dag, task
        from airflow.exceptions import AirflowException, AirflowFailException
    except ImportError:
        dag = task = None

if dag is not None and task is not None:

    def _step(argv: list[str]) -> str:
        try:
            return run_command(argv)
        except CommandFailed as exc:
            raise (AirflowException if exc.retryable else AirflowFailException)(str(exc)) from exc

    @dag(
        dag_id="batchgen_sharded",
        schedule="@daily",
        start_date=datetime(2026, 1, 1),
        catchup=False,
        default_args={"retries": 3, "retry_delay": timedelta(minutes=2)},
    )
    def batchgen_sharded() -> None:
        commands = shard_commands(JOB, OUTPUT, NUM_SHARDS, BATCHGEN)

        @task
        def shard(argv: list[str]) -> str:
            return _step(argv)

        @task
        def finalize(argv: list[str]) -> str:
            return _step(argv)

        @task
        def report(argv: list[str]) -> str:
            return _step(argv)

        shards = shard.expand(argv=commands["shards"])
        done = finalize(commands["finalize"])
        shards >> done >> report(commands["report"])

    batchgen_sharded()
