"""install_lora: an engine's LoRA parts, built from its resolved config before the KV pool is sized."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.lora.requests import LoRAAdapters
from batchgen.engine.lora.slots import LoRASlots
from batchgen.engine.lora.store import AdapterStore

_ROUND = 64  # the slot mask's rows: the largest step, rounded up


def install_lora(
    model: nn.Module, config: ResolvedConfig, hf_config: Any, device: torch.device, dtype: torch.dtype
) -> tuple[LoRASlots, LoRAAdapters]:
    """Wrap `model`'s linear layers with `config.max_loras` slots of rank `config.max_lora_rank`
    (their memory allocated now: the KV pool is sized after) -> (the slots, the adapters' reader)."""
    store = AdapterStore(config.max_cpu_loras, dtype)
    # why both: a step holds at most max_num_batched_tokens tokens, a decode graph's bucket max_num_seqs rows
    rows = max(config.max_num_batched_tokens, 2 * config.max_num_seqs)
    rows = -(-rows // _ROUND) * _ROUND
    # the Triton kernels where the triton attention backend runs (CUDA; the CPU only under its interpreter)
    kernel = config.attention_backend == "triton"
    slots = LoRASlots(model, config.max_loras, config.max_lora_rank, rows, store, device, dtype, kernel)
    return slots, LoRAAdapters(store, hf_config, config.max_lora_rank)
