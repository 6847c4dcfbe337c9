"""RequestOutput and CompletionOutput: what the engine (or any backend) returns, shaped like vLLM's.

A script written for vLLM's offline `LLM.generate` reads the same names: `request_id` (str),
`prompt`, `prompt_token_ids`, `prompt_logprobs`, `num_cached_tokens` and `outputs`, one
CompletionOutput per sample (`index`, `text`, `token_ids`, `cumulative_logprob`, `logprobs`,
`finish_reason`, `stop_reason`). Log-probabilities are vLLM's shape too: per token a dict
{token id: Logprob} holding the chosen (or prompt) token and the top K alternatives.
batchgen adds `error` (a request it could not serve: then `outputs` is empty) and usage counts.
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
    """One sample of a request. `finish_reason` is "stop" or "length".

    `stop_reason` is None on EOS (as in vLLM), else the matched stop string or the stop token id.
    `token_ids` counts every generated token, including those of a stop string cut from `text`.
    `logprobs` and `cumulative_logprob` are None unless SamplingParams.logprobs was set.
    """

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
    """One finished request: its prompt and its `n` samples (`outputs`, in sample order).

    `prompt_logprobs` (when asked) has one entry per prompt token, None for the first.
    A request that could not be served has `error` set and no outputs.
    """

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
