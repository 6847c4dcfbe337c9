"""Choosing the device's parts: the attention backend (engine.attention_backend), the model's CPU
kernels, the sampler's greedy pass and the CPU thread governor. The one place where the general
code meets the device-specific rooms.

"auto" picks "cpu" on the CPU (decode rows, and the native kernel with its C++ front where it can
attend the model); on CUDA "triton" (its paged kernel over 16-token blocks, triton/) where triton
imports and the GPU is Ampere or newer, the only backend CUDA-graph decodes replay over
(cuda/graphs); "torch" elsewhere (gathered blocks; on CUDA the paged varlen kernel where chosen).
"triton" on the CPU runs only under Triton's interpreter (TRITON_INTERPRET=1, for tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from transformers import PreTrainedModel

from batchgen.engine.attention.backend import AttentionBackend, Pools, TorchBackend
from batchgen.engine.triton import support as triton_support

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve_backend(setting: str, device: torch.device) -> str:
    """The backend's name for `setting` on `device`; a name that cannot run there is a ValueError."""
    if setting not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {setting!r}")
    if setting == "auto":
        if device.type == "cpu":
            return "cpu"
        return "triton" if triton_support.prefers_triton(device) else "torch"
    if setting == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device.type}")
    if setting == "triton":
        triton_support.check_device(device)
    return setting


def make_backend(
    name: str,
    model: PreTrainedModel,
    kv_caches: Pools,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    max_len: int,
    max_rows: int | None,
) -> AttentionBackend:
    """A new backend for one model runner (resolved `name`: see resolve_backend)."""
    if name == "cpu":
        from batchgen.engine.cpu.backend import CpuBackend  # why lazy: the CPU room loads its kernels

        return CpuBackend(kv_caches, block_size, device, model.config, dtype, max_len, max_rows)
    if name == "triton":
        from batchgen.engine.triton.backend import TritonBackend  # why lazy: it imports triton

        return TritonBackend(kv_caches, block_size, device, model.config.get_text_config().num_attention_heads)
    return TorchBackend(kv_caches, block_size, device)


def prepare_model(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> int:
    """The model's linears that the native CPU kernel runs where measured faster; how many (0 off the CPU)."""
    if device.type != "cpu":
        return 0
    from batchgen.engine.cpu.native_linear import install_native_linears

    return install_native_linears(model, device, dtype)


def fast_greedy_for(device: torch.device) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] | None:
    """The device's own greedy pass for the sampler (sampling/sampler.greedy_ids), where it has one."""
    if device.type != "cpu":
        return None
    from batchgen.engine.cpu.argmax import native_greedy_ids

    return native_greedy_ids


class StepHook(Protocol):
    def tick(self) -> None: ...

    def forget(self) -> None: ...


class _NoHook:
    def tick(self) -> None:
        return None

    def forget(self) -> None:
        return None


def step_hook_for(device: torch.device) -> StepHook:
    """What runs before each step on this device: on the CPU the thread governor (cpu/threads), which
    sets torch's threads to the CPUs other processes leave free; elsewhere nothing."""
    if device.type != "cpu":
        return _NoHook()
    from batchgen.engine.cpu.threads import ThreadGovernor

    return ThreadGovernor()


def prepare_process(device: torch.device) -> None:
    """Once per engine, before the model loads: on the CPU, freed activation memory stays in the
    process's heap instead of going back to the OS every step (cpu/heap)."""
    if device.type == "cpu":
        from batchgen.engine.cpu.heap import keep_freed_memory

        keep_freed_memory()
