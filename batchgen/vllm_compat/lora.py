"""vLLM's `vllm.lora.request` module: its LoRARequest is batchgen's (engine/api/lora_request)."""

from __future__ import annotations

from batchgen.engine.api.lora_request import LoRARequest

__all__ = ["LoRARequest"]
