"""The one small interface between the job runner and a generation backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SamplingParams

OnOutput = Callable[[RequestOutput], None]


class Backend(Protocol):
    """Generates completions for token-id prompts; returns one RequestOutput per prompt, in order.

    A request the backend cannot serve (its adapter among them) comes back with finish_reason "error" and `error` set;
    it never raises for one bad request. `on_output` is called as each request finishes.
    """

    name: str
    max_model_len: int

    def resolved(self) -> dict[str, str]:
        """What this process resolved that changes generated numbers, for the job record
        (`runtime_record`): {"device": "cpu" | "cuda" | ..., "dtype": "float32" | ...}, and any
        further setting the engine resolves (its attention backend) under its own name."""
        ...

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_output: OnOutput | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """`adapters`: per prompt, the name of its LoRA adapter in model.lora (None: the base
        model); None: every prompt runs the base model."""
        ...
