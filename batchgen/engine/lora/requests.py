"""LoRAAdapters: what `LLM.generate(..., lora_request=...)` turns into for the engine.

Why apart from llm.py: a request's adapter is read and checked here (engine/lora/spec), its weights
put in the host store, and it becomes the request's extras (its content hash: the identity the
scheduler's slots and the prefix cache use). An adapter that cannot be read or is refused becomes
that request's error output (a job's error row), never an exception for the whole call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from batchgen.engine.api.lora_request import LoRARequest
from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras
from batchgen.engine.lora.spec import AdapterRefused, AdapterSpec, check_adapter, read_adapter
from batchgen.engine.lora.store import AdapterStore

NOT_ENABLED = (
    "lora_request needs an engine built with LoRA: LLM(model, enable_lora=True, max_loras=..., max_lora_rank=...)"
)


def per_prompt(lora_request: object, n: int) -> list[LoRARequest | None]:
    """`lora_request` (None, one request, or one per prompt) as one entry per prompt."""
    items: list[Any] = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
    if len(items) != n:
        raise ValueError(f"got {n} prompts but {len(items)} lora_requests")
    for i, item in enumerate(items):
        if item is not None and not isinstance(item, LoRARequest):
            raise TypeError(f"lora_request {i}: expected a LoRARequest or None, got {type(item).__name__}")
    return items


class LoRAAdapters:
    """The adapters an LLM serves: read, checked against its model, their weights in `store`."""

    def __init__(self, store: AdapterStore, hf_config: Any, max_lora_rank: int) -> None:
        self.store, self.hf_config, self.max_lora_rank = store, hf_config, max_lora_rank

    def resolve(self, requests: Sequence[LoRARequest | None]) -> tuple[list[RequestExtras], list[str | None]]:
        """Each prompt's extras (its adapter's content hash) and refusal (None: it may run)."""
        found: dict[tuple[str, str], AdapterSpec | str] = {}
        extras: list[RequestExtras] = []
        refusals: list[str | None] = []
        for request in requests:
            if request is None:
                extras.append(NO_EXTRAS)
                refusals.append(None)
                continue
            key = (request.lora_name, request.lora_path)
            if key not in found:
                found[key] = self._load(request)
            spec = found[key]
            if isinstance(spec, str):
                extras.append(NO_EXTRAS)
                refusals.append(spec)
            else:
                extras.append(RequestExtras(adapter_hash=spec.content_hash))
                refusals.append(None)
        return extras, refusals

    def _load(self, request: LoRARequest) -> AdapterSpec | str:
        """The adapter's spec with its weights in the store, or why it cannot run."""
        try:
            spec = read_adapter(request.lora_name, request.lora_path)
            check_adapter(spec, self.hf_config, self.max_lora_rank)
            self.store.add(spec)
        except AdapterRefused as exc:
            return str(exc)
        return spec
