"""Placement groups for tensor-parallel Ray workers: one per replica, its N GPUs reserved together.

Why a group rather than `num_gpus=N` alone: the reservation is atomic and names one node
(STRICT_PACK), the replica's ranks talk over that node's links, and a replacement worker (its
predecessor died) is started into the same group, so it finds the same GPUs free. The engine
actor takes the whole bundle; it starts ranks 1..N-1 itself (engine/parallel), as its children,
which see the bundle's GPUs through the CUDA_VISIBLE_DEVICES Ray gives the actor. On a cluster
without GPUs the bundle is the worker's CPUs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from batchgen.errors import ExecutorError
from batchgen.run.executors.ray_cluster import WorkerShape

READY_SECONDS = 120.0  # how long a replica's group may take to be placed before the job stops


def replica_group(ray: ModuleType, shape: WorkerShape, size: int) -> Any:
    """A placed group of one bundle: `shape`'s CPUs and GPUs (= `size` on a GPU cluster)."""
    from ray.util.placement_group import placement_group

    bundle = {"CPU": shape.cpus, **({"GPU": float(shape.gpus)} if shape.gpus else {})}
    group = placement_group([bundle], strategy="STRICT_PACK")
    ready, _ = ray.wait([group.ready()], timeout=READY_SECONDS)
    if not ready:
        ray.util.remove_placement_group(group)
        raise ExecutorError(
            f"executor: no Ray node could hold a tensor-parallel worker ({bundle}, tensor_parallel_size {size}) "
            f"within {READY_SECONDS:g} s; lower executor.num_workers or use nodes with {size} GPUs"
        )
    return group


def in_group(group: Any) -> Any:
    """The scheduling strategy that puts an actor in `group`'s bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=0)


def release_groups(ray: ModuleType, groups: dict[int, Any]) -> None:
    """Remove every replica's group (its actors are killed first by the caller)."""
    for group in groups.values():
        ray.util.remove_placement_group(group)
    groups.clear()
