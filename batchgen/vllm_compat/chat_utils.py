"""vLLM's `resolve_hf_chat_template` (`vllm.entrypoints.chat_utils`): the chat template a client renders with.

The template given, else the tokenizer's own (batchgen's `LLM.chat` renders with the same one).
"""

from __future__ import annotations

from typing import Any


def resolve_hf_chat_template(
    tokenizer: Any, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None, **_: Any
) -> str | None:
    """`chat_template` if given, else the tokenizer's `chat_template` (None when it has none).
    Other keywords vLLM takes (model_config, trust_remote_code) change nothing here."""
    if chat_template is not None:
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    return template if isinstance(template, str) else None
