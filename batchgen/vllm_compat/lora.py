"""vLLM's LoRARequest (`vllm.lora.request`), so clients that build one import; generate refuses it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """An adapter request as vLLM spells it; batchgen serves no adapters (merge it into the weights)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
