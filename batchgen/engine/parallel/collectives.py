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

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle


class CollectiveError(RuntimeError):
    """A collective failed: a rank died or timed out (the message says which operation)."""


def _all_reduce(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
    try:
        dist.all_reduce(output)
    except RuntimeError as exc:  # why wrap: gloo/NCCL's text does not say which step of ours failed
        raise CollectiveError(f"tensor parallel all-reduce after {type(module).__name__} failed: {exc}") from exc
    return output


def _gather_head(vocab: int) -> object:
    def hook(module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(output) for _ in range(dist.get_world_size())]
        try:
            dist.all_gather(parts, output.contiguous())
        except RuntimeError as exc:
            raise CollectiveError(f"tensor parallel all-gather of the LM head failed: {exc}") from exc
        return torch.cat(parts, dim=-1)[..., :vocab]  # [..., V]

    return hook


def install(model: nn.Module, row_parallel: list[str], head: str | None, vocab: int) -> list[RemovableHandle]:
    """All-reduce after each module named in `row_parallel`, and gather the head `head` (None: the
    head is replicated, nothing to gather); returns the hooks' handles."""
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(_all_reduce) for name in row_parallel]
    if head is not None:
        handles.append(modules[head].register_forward_hook(_gather_head(vocab)))  # type: ignore[arg-type]
    return handles
