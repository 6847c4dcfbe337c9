"""LoRARequest: which adapter a request runs under, as vLLM spells it (`vllm.lora.request`).

Why vLLM's shape: scripts written for vLLM build `LoRARequest(name, int_id, path)` and pass it to
`generate(..., lora_request=...)`. The engine identifies the adapter by the content hash of the
folder's files (engine/lora/spec), never by this name or id, which a caller may reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(unsafe_hash=True)
class LoRARequest:
    """An adapter for a request: its name, a positive integer id (vLLM's), and its local PEFT folder.
    Equal and hashed by name alone (vLLM's rule: one name, one adapter)."""

    lora_name: str
    lora_int_id: int = field(compare=False)
    lora_path: str = field(default="", compare=False)
    base_model_name: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(
                f"LoRARequest({self.lora_name!r}): lora_int_id must be an integer > 0, got {self.lora_int_id!r}"
            )

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def local_path(self) -> str:
        return self.lora_path
