"""Order a window's requests for the engine: shared prefixes adjacent, then by length.

Why: adjacent prompts with a common prefix hit the prefix cache while its blocks are still
resident, and similar lengths keep batches dense. Output order is restored by the runner.
"""

from __future__ import annotations

from typing import Literal

Strategy = Literal["prefix", "length", "none"]
PREFIX_KEY_TOKENS = 64  # prompts agreeing on this many leading tokens form one group


def order_requests(prompts: list[list[int]], strategy: Strategy) -> list[int]:
    """Indices into `prompts`, in the order to hand them to the engine."""
    indices = range(len(prompts))
    if strategy == "none":
        return list(indices)
    if strategy == "length":
        return sorted(indices, key=lambda i: -len(prompts[i]))
    if strategy == "prefix":
        # Lexicographic on the leading tokens puts every prompt sharing a prefix next to the others
        # that share it (a shorter common prefix still makes a contiguous run); longest first
        # inside a group so that long prefills start early and the tail of the window is short.
        return sorted(indices, key=lambda i: (prompts[i][:PREFIX_KEY_TOKENS], -len(prompts[i])))
    raise ValueError(f"unknown ordering strategy {strategy!r} (expected prefix, length or none)")
