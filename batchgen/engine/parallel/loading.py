"""Loading one rank's share of a model: built from the rank's config with empty weights, then filled
tensor by tensor from the safetensors files with only the rows and columns the rank holds.

Why not `from_pretrained` and slicing after: every rank would hold the whole model for a moment.

The two collectives a sharded forward needs are installed as forward hooks on the unchanged
modules (so the module tree and parameter names stay as transformers built them): row-parallel
o_proj/down_proj outputs are all-reduced; the vocab-split LM head's kept rows are all-gathered
(the sampler and its features read whole rows on rank 0; [rows, V] is small).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from batchgen.engine.attention.interface import ATTN_IMPLEMENTATION
from batchgen.engine.parallel.plan import HEAD, ROW, ShardPlan, rank_config, shard_plan
from batchgen.engine.runner.models import check_config, check_model

logger = logging.getLogger(__name__)


class CollectiveError(RuntimeError):
    """A collective failed: a rank died or timed out (the message says which operation)."""


class Collectives:
    """One group's process group (gloo on the CPU, NCCL on CUDA) over a file store, not the default
    group, so several engines share a process; `timeout_s` bounds every collective. Its two
    collectives are forward hooks on the unchanged modules."""

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

    def all_reduce(self, module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
        """A row-parallel module's `output`, summed over the ranks in place."""
        try:
            self.group.allreduce([output]).wait()
        except RuntimeError as exc:  # why wrap: gloo/NCCL's text does not say which step of ours failed
            raise CollectiveError(f"tensor parallel all-reduce after {type(module).__name__} failed: {exc}") from exc
        return output

    def gather_head(self, module: nn.Module, args: tuple[object, ...], output: torch.Tensor) -> torch.Tensor:
        """The vocab-split LM head's rows of every rank, in rank order -> [..., V] (V: its out_features)."""
        parts = [torch.empty_like(output) for _ in range(self.world)]
        try:
            self.group.allgather([parts], [output.contiguous()]).wait()
        except RuntimeError as exc:
            raise CollectiveError(f"tensor parallel all-gather of the LM head failed: {exc}") from exc
        return torch.cat(parts, dim=-1)[..., : module.out_features]  # [..., V]


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters created inside are empty (meta); buffers (RoPE frequencies) are real, as built."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path}: tensor parallelism loads safetensors weights; no model.safetensors here")
    with safe_open(str(single), "pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


def _read_share(handle: Any, key: str, name: str, plan: ShardPlan) -> torch.Tensor:
    """The rows (and, for a row-parallel weight, the columns) of parameter `name` (saved as `key`)
    this rank holds."""
    piece = handle.get_slice(key)
    shape = piece.get_shape()
    cols = plan.columns(name)
    parts = [piece[a:b] if cols is None else piece[a:b, cols[0] : cols[1]] for a, b in plan.rows(name, shape[0])]
    tensor = torch.cat(parts) if len(parts) > 1 else parts[0]
    if name.split(".")[-2:-1] == [HEAD] and tensor.shape[0] < plan.vocab_shard:  # the last share, padded
        pad = tensor.new_zeros((plan.vocab_shard - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    return torch.zeros_like(tensor) if plan.zero_bias(name) else tensor


def _fill(model: PreTrainedModel, path: Path, plan: ShardPlan, device: torch.device, dtype: torch.dtype) -> None:
    """Every parameter of `model` (on meta) from the checkpoint's share; shapes checked."""
    files = _weight_files(path)
    tied = model.get_output_embeddings() is not None and bool(
        getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    )
    modules = dict(model.named_modules())
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        for name, param in list(model.named_parameters()):
            if tied and name.split(".")[-2] == HEAD:
                continue  # tied: set to the embeddings below
            key = next((k for k in (name, *SAVED_AS.get(name, ())) if k in files), None)
            if key is None:
                raise KeyError(f"{path}: the checkpoint has no tensor {name!r} (tensor parallel loading)")
            file = files[key]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), "pt", device="cpu"))
            tensor = _read_share(handles[file], key, name, plan)
            # the head (padded vocabulary rows) and GPT-NeoX's attention projections, sized by the
            # module from hidden_size, not from its heads, take the share the plan cut
            resized = name.split(".")[-2] in (HEAD, *RESIZED)
            if not resized and tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"{file.name}: tensor {name!r} share {tuple(tensor.shape)} does not fit the rank's "
                    f"module {tuple(param.shape)} (tensor parallel rank {plan.rank} of {plan.world})"
                )
            owner, _, leaf = name.rpartition(".")
            modules[owner]._parameters[leaf] = nn.Parameter(tensor.to(device, dtype), requires_grad=False)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight


# Parameters that checkpoints store under another name (transformers renames them when it loads).
SAVED_AS = {"lm_head.weight": ("embed_out.weight",)}  # GPT-NeoX
RESIZED = ("query_key_value", "dense")  # GPT-NeoX: Linear(hidden, 3 * hidden) and Linear(hidden, hidden)


def _fix_head_size(model: PreTrainedModel, plan: ShardPlan) -> None:
    """GPT-NeoX derives its head size as hidden_size // num_attention_heads at init, which the
    rank's smaller head count doubles: put the true head size (and what follows from it) back."""
    for module in model.modules():
        size = getattr(module, "head_size", None)
        if isinstance(size, int) and hasattr(module, "rotary_ndims") and size != plan.head_dim:
            rope = getattr(model.config.get_text_config(), "rope_parameters", None) or {}
            factor = float(rope.get("partial_rotary_factor", 1.0))
            fixed = {"head_size": plan.head_dim, "rotary_ndims": int(plan.head_dim * factor)}
            for attribute, value in {**fixed, "scaling": plan.head_dim**-0.5}.items():
                setattr(module, attribute, value)


def load_sharded_model(
    path: str, comm: Collectives, rank: int, device: torch.device, dtype: torch.dtype
) -> PreTrainedModel:
    """Rank `rank`'s share of the model at `path`, its all-reduces and gather going through `comm`."""
    world = comm.world
    config = AutoConfig.from_pretrained(path)
    check_config(config)
    plan = shard_plan(config, rank, world)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(rank_config(config, plan), attn_implementation=ATTN_IMPLEMENTATION)
    _fill(model, Path(path), plan, device, dtype)
    _fix_head_size(model, plan)
    model.to(device)  # the buffers
    with contextlib.suppress(OSError):
        model.generation_config = GenerationConfig.from_pretrained(path)
    check_model(model)
    head = model.get_output_embeddings()
    gathered = head is not None and head.weight is not model.get_input_embeddings().weight  # tied: replicated
    if gathered:
        head.out_features = plan.vocab  # the width after the gather
        head.register_forward_hook(comm.gather_head)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in ROW:
            module.register_forward_hook(comm.all_reduce)
    model.eval()
    logger.info(
        "tensor parallel rank %d/%d: heads %s, KV heads %s, MLP %d, head %s",
        rank,
        world,
        plan.heads,
        plan.kv_heads,
        plan.intermediate // world,
        f"{plan.vocab_shard} rows, gathered" if gathered else "replicated (tied)",
    )
    return model
