"""Error types of a job and the process exit code each maps to (cron and Airflow branch on them)."""

from __future__ import annotations


class BatchgenError(Exception):
    """Base of every error the CLI turns into a message and an exit code."""

    exit_code = 1


class JobFileError(BatchgenError):
    """The job file (or a --set override) is invalid: nothing has run."""

    exit_code = 2


class InputDataError(BatchgenError):
    """The input data cannot be read as the job describes (missing file or column, corrupt file)."""

    exit_code = 3


class ModelError(BatchgenError):
    """The model folder cannot be loaded or is not supported."""

    exit_code = 4


class OutputError(BatchgenError):
    """The output folder cannot be written."""

    exit_code = 5


class EngineFailure(BatchgenError):
    """The engine failed mid-job; committed parts are kept and a rerun resumes (retryable)."""

    exit_code = 6


class LockedError(BatchgenError):
    """Another live run holds this output folder."""

    exit_code = 7


class IncompleteOutput(BatchgenError):
    """`finalize`: parts of the job are not committed yet (a shard has not finished)."""

    exit_code = 8


class StoreUnavailable(OutputError):
    """The object store kept failing with transient errors (connection drops, 5xx, throttling)
    after every retry the policy allows; committed parts are kept, a rerun resumes (retryable)."""

    exit_code = 10


class ExecutorError(BatchgenError):
    """`executor: {kind: ray}` cannot start: Ray is not installed, no cluster answers at
    executor.address, or the cluster cannot hold the workers asked for. Nothing has run."""

    exit_code = 9


class FingerprintMismatch(BatchgenError):
    """The output folder was made by a different job."""

    exit_code = 2


class Interrupted(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no `except Exception`
    on the way (the engine's failure handling above all) can swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_KERNELS_UNBUILT = 11  # `doctor --build`: a native kernel could not be built on this machine
EXIT_INTERRUPTED_BASE = 128  # + the signal number: 130 for SIGINT, 143 for SIGTERM
