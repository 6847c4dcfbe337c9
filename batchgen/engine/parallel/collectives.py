"""The two collectives a tensor-parallel forward needs, installed as forward hooks on unchanged modules.

Row-parallel o_proj/down_proj outputs are all-reduced; the vocab-split LM head's kept rows are
all-gathered (the sampler and its features read whole rows on rank 0; [rows, V] is small). Why
hooks: the module tree and parameter names stay as transformers built them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle


class CollectiveError(RuntimeError):
    """A collective failed: a rank died or timed out (the message says which operation)."""


class Collectives:
    """One group's process group (gloo on the CPU, NCCL on CUDA) over a file store, not the default
    group, so several engines share a process; `timeout_s` bounds every collective."""

    def __init__(self, store_path: str, rank: int, world: int, device: torch.device, timeout_s: float) -> None:
        store = dist.FileStore(store_path, world)
        timeout = timedelta(seconds=timeout_s)
        self.world = world
        self.group: Any
        if device.type == "cuda":  # pragma: no cover - needs 2+ GPUs
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world, options)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world, timeout)

    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        """Sum `tensor` over the ranks, in place."""
        try:
            self.group.allreduce([tensor]).wait()
        except RuntimeError as exc:  # why wrap: gloo/NCCL's text does not say which step of ours failed
            raise CollectiveError(f"tensor parallel all-reduce after {what} failed: {exc}") from exc

    def all_gather(self, tensor: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's `tensor`, in rank order."""
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        try:
            self.group.allgather([parts], [tensor.contiguous()]).wait()
        except RuntimeError as exc:
            raise CollectiveError(f"tensor parallel all-gather of {what} failed: {exc}") from exc
        return parts


def install(
    model: nn.Module, comm: Collectives, row_parallel: list[str], head: str | None, vocab: int
) -> list[RemovableHandle]:
    """All-reduce after each module named in `row_parallel`, and gather the head `head` (None: the
    head is replicated, nothing to gather); returns the hooks' handles."""
    modules = dict(model.named_modules())

    def reduce(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(output, type(module).__name__)
        return output

    def gather(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
        return torch.cat(comm.all_gather(output, "the LM head"), dim=-1)[..., :vocab]  # [..., V]

    handles = [modules[name].register_forward_hook(reduce) for name in row_parallel]
    if head is not None:
        handles.append(modules[head].register_forward_hook(gather))
    return handles
