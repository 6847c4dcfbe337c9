"""The loop that runs a list of prompts through an Engine to completion, outputs in input order.

Why apart from the Engine: the engine is a step machine (add requests, step, abort); this is
one way to drive it, the one `LLM.generate` and the job runner use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SamplingParams


class StepMachine(Protocol):
    """What this loop needs of an engine (why a protocol: the engine calls this loop, so this
    module must not import it back)."""

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> int: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


def run_to_completion(
    engine: StepMachine,
    prompts: list[list[int]],
    params: list[SamplingParams],
    on_output: Callable[[RequestOutput], None] | None,
    texts: list[str | None],
) -> list[RequestOutput]:
    """Add every prompt, step until all are answered; each output's request_id becomes its index."""
    position = {str(engine.add_request(p, sp, text)): i for i, (p, sp, text) in enumerate(zip(prompts, params, texts))}
    results: list[RequestOutput | None] = [None] * len(prompts)
    while engine.has_unfinished():
        for output in engine.step():
            index = position.get(output.request_id)
            if index is None:
                continue  # a request added outside this call
            output.request_id = str(index)
            results[index] = output
            if on_output is not None:
                on_output(output)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"the engine stopped with requests {missing[:10]} unanswered")
    return results  # type: ignore[return-value]
