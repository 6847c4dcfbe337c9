"""RequestOutput and CompletionOutput: what the engine (or any backend) returns, shaped like vLLM's.

A script written for vLLM's offline `LLM.generate` reads the same names (logprobs: per token a dict
{token id: Logprob}); batchgen adds `error` (then `outputs` is empty) and usage counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# One position's log-probabilities: the chosen token and the top-K alternatives, by token id.
PositionLogprobs = dict[int, "Logprob"]


@dataclass
class Logprob:
    """vLLM's Logprob: the log-probability, its 1-based rank in the distribution, the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request. `finish_reason` "stop" or "length"; `stop_reason` None on EOS (as
    vLLM), else the stop string or token id; `token_ids` include a stop string cut from `text`."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One finished request: its prompt and its `n` samples in order (`prompt_logprobs`: None for
    the first prompt token); one that could not be served has `error` and no outputs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    finished: bool = True
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens over all samples: what the request is billed for."""
        return sum(len(o.token_ids) for o in self.outputs)
