"""The one door from the general code to the device rooms: a device's Platform, and the attention
backend a resolved setting names.

Why here, above engine/cpu, engine/cuda and engine/triton: the rooms above (runner, llm, doctor,
the job's progress line) ask a Platform (api/platform) every device-specific question and never
import a device room themselves; the backend is picked by its resolved name (a setting), never by
the device's type inside a kernel. Why lazy: the CPU room and the Triton backend load kernels and
triton, which a process on another device never needs.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.api.platform import Platform
from batchgen.engine.attention.backend import AttentionBackend, Pools, TorchBackend


def platform_for(device: torch.device | str) -> Platform:
    """The Platform of `device` (a new one: it keeps no state)."""
    device = torch.device(device)
    if device.type == "cpu":
        from batchgen.engine.cpu.platform import CpuPlatform

        return CpuPlatform(device)
    if device.type == "cuda":
        from batchgen.engine.cuda.platform import CudaPlatform

        return CudaPlatform(device)
    return Platform(device)


def make_backend(
    config: ResolvedConfig, model: PreTrainedModel, kv_caches: Pools, device: torch.device, dtype: torch.dtype
) -> AttentionBackend:
    """A new backend for one model runner: the one `config.attention_backend` names (Platform.attention_backend's)."""
    name, block_size = config.attention_backend, config.block_size
    if name == "cpu":
        from batchgen.engine.cpu.backend import make_cpu_backend

        max_len, max_rows = config.max_model_len, config.max_num_seqs
        return make_cpu_backend(kv_caches, block_size, device, model.config, dtype, max_len, max_rows)
    if name == "triton":
        from batchgen.engine.triton.backend import TritonBackend

        return TritonBackend(kv_caches, block_size, device, model.config.get_text_config().num_attention_heads)
    return TorchBackend(kv_caches, block_size, device)
