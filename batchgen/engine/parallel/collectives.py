"""The two collectives a tensor-parallel forward needs, installed as forward hooks on unchanged modules.

Row-parallel projections (o_proj, down_proj) each produce a partial sum of the full output: one
all-reduce makes it whole on every rank. The LM head is split by vocabulary rows (each rank
scores its ceil(V / N) tokens): one all-gather of the kept rows' logits gives every rank the full
row, cut back to V. Why hooks, not wrapper modules: the module tree, its parameter names and the
native-linear routing (which swaps a Linear's class) stay exactly as transformers built them.

Why a gathered head rather than a vocab-parallel one fed to the sampler: the sampler, penalties,
grammar masks and logprobs all read whole rows on rank 0; the gather moves only the kept rows
(one per sampled sequence), [rows, V] floats, which is small beside the forward.
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
    """One tensor-parallel group's process group (gloo on the CPU, NCCL on CUDA), made directly
    over a file store rather than as torch.distributed's process-wide default group: several
    engines (and a user's own torch.distributed work) can then live in one process. `timeout_s`
    bounds every collective: a rank that stops answering fails the others instead of hanging them."""

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
