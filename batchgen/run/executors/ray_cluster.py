"""Reaching Ray for the Ray executor: importing it (a clear error naming the extra to install),
joining the cluster at `executor.address` or starting a local instance, and sizing the engine
workers to the cluster's resources."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from batchgen.errors import ExecutorError
from batchgen.job.sections import ExecutorSection

INSTALL = "pip install 'batchgen[ray]'"


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as exc:
        raise ExecutorError(f"executor.kind is ray, but Ray is not installed here; install it with: {INSTALL}") from exc
    return ray


@dataclass(frozen=True)
class WorkerShape:
    count: int
    cpus: float
    gpus: int


def plan_workers(section: ExecutorSection, resources: dict[str, float]) -> WorkerShape:
    """How many workers, with what each, from the job's executor section and the cluster's resources."""
    cluster_gpus, cluster_cpus = int(resources.get("GPU", 0)), float(resources.get("CPU", 0))
    gpus = section.worker_gpus if cluster_gpus else 0  # a CPU-only cluster: CPU workers
    count = section.num_workers or (cluster_gpus // gpus if gpus else 1)
    cpus = section.worker_cpus or (1.0 if gpus else max(1.0, float(cluster_cpus // count)))
    if count * gpus > cluster_gpus or count * cpus > cluster_cpus:
        raise ExecutorError(
            f"executor: {count} worker(s) of {cpus:g} CPU(s) and {gpus} GPU(s) do not fit the Ray cluster "
            f"({cluster_cpus:g} CPUs, {cluster_gpus} GPUs); lower executor.num_workers or executor.worker_cpus"
        )
    return WorkerShape(count, cpus, gpus)


def connect(ray: ModuleType, address: str | None, quiet: bool) -> bool:
    """Join the cluster at `address`, or start a local instance (null); True when this run must shut
    it down. A Ray already initialised in this process (a notebook, a test) is used as it is."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"logging_level": logging.ERROR if quiet else logging.WARNING, "log_to_driver": not quiet}
    if address is None:
        # Why "local": never an unrelated running cluster. Why niceness 0: Ray nices its workers to 15,
        # which starves the engine of CPU beside any other work on the machine; a local run is not niced.
        kwargs.update(address="local", include_dashboard=False, _system_config={"worker_niceness": 0})
    else:
        kwargs["address"] = address
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as exc:
        if address is None:
            raise ExecutorError(f"executor: cannot start a local Ray instance: {exc}") from exc
        raise ExecutorError(
            f"executor.address {address!r}: no Ray cluster answers there ({exc}); start one with `ray start --head` "
            "on its head node, or set executor.address: null to start a Ray instance on this machine"
        ) from exc
    return True
