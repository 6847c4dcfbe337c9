"""`vllm.utils.print_utils.print_embeddings`: the helper vLLM's embed and reward examples print with.

Why a print in the library: it is the vLLM function's whole job (a script's output), called by
the script, never by batchgen.
"""

from __future__ import annotations

from collections.abc import Sequence


def print_embeddings(embeds: Sequence[float], prefix: str = "Embeddings") -> None:
    """One line: the first four values (then `...`) and the vector's size."""
    shown = ", ".join(repr(float(v)) for v in embeds[:4]) + (", ..." if len(embeds) > 4 else "")
    print(f"{prefix}: [{shown}] (size={len(embeds)})")


__all__ = ["print_embeddings"]
