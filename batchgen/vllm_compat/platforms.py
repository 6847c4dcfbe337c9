"""What vLLM's example scripts import besides the LLM API, so that they run unchanged:
`vllm.platforms.current_platform` (which accelerator torch sees: answered truthfully),
`vllm.config.AttentionConfig` and `AttentionBackendEnum` (vLLM's attention backends by name).

batchgen chooses its own attention backend (`attention_backend=`): an `attention_config` passed
to LLM is refused unless it is None, as any unused engine argument off its default.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class AttentionBackendEnum(enum.Enum):
    """vLLM's attention backend names (none of them is batchgen's: see the module docstring)."""

    FLASH_ATTN = "FLASH_ATTN"
    TRITON_ATTN = "TRITON_ATTN"
    FLEX_ATTENTION = "FLEX_ATTENTION"
    TORCH_SDPA = "TORCH_SDPA"
    FLASHINFER = "FLASHINFER"
    ROCM_ATTN = "ROCM_ATTN"
    CPU_ATTN = "CPU_ATTN"


@dataclass
class AttentionConfig:
    """vLLM's attention settings; `backend` None is vLLM's automatic choice."""

    backend: AttentionBackendEnum | str | None = None


class _Platform:
    """The accelerator torch sees (vLLM's `current_platform` questions)."""

    def is_rocm(self) -> bool:
        return torch.cuda.is_available() and getattr(torch.version, "hip", None) is not None

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and not self.is_rocm()

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_xpu(self) -> bool:
        xpu: Any = getattr(torch, "xpu", None)
        return bool(xpu is not None and xpu.is_available())

    def is_tpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not (self.is_cuda_alike() or self.is_xpu())

    @property
    def device_type(self) -> str:
        return "cuda" if self.is_cuda_alike() else "xpu" if self.is_xpu() else "cpu"


current_platform = _Platform()

__all__ = ["AttentionBackendEnum", "AttentionConfig", "current_platform"]
