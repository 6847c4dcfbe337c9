"""LoRARequest: which adapter a request runs under, as vLLM spells it (`vllm.lora.request`).

Why vLLM's shape: scripts written for vLLM build `LoRARequest(name, int_id, path)` and pass it to
`generate(..., lora_request=...)`. The engine identifies the adapter by the content hash of the
folder's files (engine/lora/spec), never by this name or id, which a caller may reuse.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class LoRARequest:
    """An adapter for a request: its name, a positive integer id (vLLM's), and its local PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

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

    def __eq__(self, other: object) -> bool:  # vLLM's rule: one name, one adapter
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
