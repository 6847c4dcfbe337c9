"""One prompt as the callers of `LLM.generate`, `embed` and `classify` give it -> its token ids and text.

Why one function: generation and pooling take the same prompt shapes (vLLM's): a string, a list of
token ids, or a `{"prompt": str}` / `{"prompt_token_ids": [...]}` dict, parsed and refused alike.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

PromptInput = str | list[int] | dict[str, Any]
_KEYS = frozenset({"prompt", "prompt_token_ids"})


def encode_prompt(
    tokenizer: Any, index: int, prompt: object, extra_keys: Collection[str] = ()
) -> tuple[list[int], str | None]:
    """(token ids, the prompt's text or None) of prompt `index`; a string is tokenized with special
    tokens. A dict key outside prompt / prompt_token_ids / `extra_keys` is a TypeError naming it."""
    text: object = None
    if isinstance(prompt, dict):
        keys = _KEYS | set(extra_keys)
        unknown = sorted(set(prompt) - keys)
        if unknown:
            raise TypeError(f"prompt {index}: unsupported key(s) {unknown} (supported: {', '.join(sorted(keys))})")
        text = prompt.get("prompt")
        prompt = prompt.get("prompt_token_ids", text)
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"]), prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [int(t) for t in prompt], text if isinstance(text, str) else None
    raise TypeError(
        f"prompt {index} must be a string, a list of token ids, or a dict with 'prompt' or "
        f"'prompt_token_ids', got {type(prompt).__name__}"
    )


def outside_vocabulary(token_ids: list[int], vocab_size: int) -> str | None:
    """Why `token_ids` cannot run (None: they can). Why refused before the forward: an id past the
    embedding table would crash the whole batch's forward (on CUDA, the process)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})" if bad else None
