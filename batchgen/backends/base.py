"""The one small interface between the job runner and a generation backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from batchgen.engine.outputs import RequestOutput
from batchgen.engine.params import SamplingParams

OnOutput = Callable[[RequestOutput], None]


class Backend(Protocol):
    """Generates completions for token-id prompts; returns one RequestOutput per prompt, in order.

    A request the backend cannot serve comes back with finish_reason "error" and `error` set;
    it never raises for one bad request. `on_output` is called as each request finishes.
    """

    name: str
    max_model_len: int

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams], on_output: OnOutput | None = None
    ) -> list[RequestOutput]: ...


def context_length(config: Any) -> int:
    """The model's context length from its HF config (names differ per architecture)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"cannot tell the context length of a {type(config).__name__}; set engine.max_model_len")


def eos_token_ids(generation_config: Any, tokenizer: Any) -> set[int]:
    """Every EOS id: the generation config's (an int or a list) and the tokenizer's."""
    ids: set[int] = set()
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
