"""Choosing the device's parts: the attention backend (engine.attention_backend) and the model's
CPU kernels. The one place where the runner's general code meets the device-specific rooms.

"auto" keeps the choices the engine made before backends had names: "cpu" on the CPU (decode
rows, and the native kernel with its C++ front where it can attend the model), "torch" elsewhere
(gathered blocks; on CUDA the paged varlen kernel and CUDA-graph decodes where chosen).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from batchgen.engine.attention.backend import AttentionBackend, Pools, TorchBackend

ATTENTION_BACKENDS = ("auto", "torch", "cpu")


def resolve_backend(setting: str, device: torch.device) -> str:
    """The backend's name for `setting` on `device`; a name that cannot run there is a ValueError."""
    if setting not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {setting!r}")
    if setting == "auto":
        return "cpu" if device.type == "cpu" else "torch"
    if setting == "cpu" and device.type != "cpu":
        raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device.type}")
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
    return TorchBackend(kv_caches, block_size, device)


def prepare_model(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> int:
    """The model's linears that the native CPU kernel runs where measured faster; how many (0 off the CPU)."""
    if device.type != "cpu":
        return 0
    from batchgen.engine.cpu.native_linear import install_native_linears

    return install_native_linears(model, device, dtype)
