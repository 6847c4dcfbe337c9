"""Order a window's requests for the engine: shared prefixes adjacent, then by length.

Why: adjacent prompts with a common prefix hit the prefix cache while its blocks are still
resident, and similar lengths keep batches dense. Output order is restored by the runner.
"""

from __future__ import annotations

from typing import Literal

Strategy = Literal["prefix", "length", "none"]
PREFIX_KEY_TOKENS = 64  # prompts agreeing on this many leading tokens form one group


def order_requests(prompts: list[list[int]], strategy: Strategy, adapters: list[str | None] | None = None) -> list[int]:
    """Indices into `prompts`, in the order to hand them to the engine. `adapters`: each prompt's
    LoRA adapter (None: the base model); with prefix or length ordering each adapter's prompts come
    together (base first), so an adapter's rows run while it is resident."""
    indices = range(len(prompts))
    if strategy == "none":
        return list(indices)
    if adapters is not None:
        by_adapter: dict[str | None, list[int]] = {}
        for i in indices:
            by_adapter.setdefault(adapters[i], []).append(i)
        out: list[int] = []
        for name in sorted(by_adapter, key=lambda a: (a is not None, a or "")):
            members = by_adapter[name]
            out += [members[j] for j in order_requests([prompts[i] for i in members], strategy)]
        return out
    if strategy == "length":
        return sorted(indices, key=lambda i: -len(prompts[i]))
    if strategy == "prefix":
        # Lexicographic on the leading tokens puts every prompt sharing a prefix next to the others
        # that share it (a shorter common prefix still makes a contiguous run); longest first
        # inside a group so that long prefills start early and the tail of the window is short.
        # The tokens every prompt of the window starts with (a chat template's header, a system
        # prompt) are skipped first: they would make one group of the window, ordered by length
        # across its documents (a part of the prefix plan holds a few documents behind one header).
        skip = _common_prefix(prompts)
        return sorted(indices, key=lambda i: (prompts[i][skip : skip + PREFIX_KEY_TOKENS], -len(prompts[i])))
    raise ValueError(f"unknown ordering strategy {strategy!r} (expected prefix, length or none)")


def _common_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (that of the lexicographically least and
    greatest prompt, which bound all others)."""
    if not prompts:
        return 0
    low, high = min(prompts), max(prompts)
    n = 0
    for a, b in zip(low, high):
        if a != b:
            break
        n += 1
    return n
