"""The engine's output side (vLLM's output processor): each request's n samples (a Sequence, its stop
checker and logprobs; samples 1..n-1 forked by the scheduler when the prompt's prefill ends), its
prompt logprobs, and the RequestOutput they become. Samples only read their Sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from batchgen.engine.api.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.stopping import StopChecker


@dataclass
class SampleState:
    """One sample: its sequence, stop checker, and logprobs when asked."""

    index: int
    seq: Sequence
    stop: StopChecker
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    done: bool = False

    def record(self, entry: PositionLogprobs, logprob: float) -> None:
        if self.logprobs is None:
            self.logprobs, self.cumulative_logprob = [], 0.0
        self.logprobs.append(entry)
        self.cumulative_logprob = (self.cumulative_logprob or 0.0) + logprob

    def completion(self) -> CompletionOutput:
        asked = self.seq.params.logprobs is not None
        return CompletionOutput(
            index=self.index,
            text=self.stop.text,
            token_ids=self.seq.output_token_ids,
            cumulative_logprob=(self.cumulative_logprob or 0.0) if asked else None,
            logprobs=(self.logprobs or []) if asked else None,
            finish_reason=self.stop.finish_reason or "length",
            stop_reason=self.stop.stop_reason,
        )


@dataclass
class RequestState:
    """A request in flight: samples[0] is the sequence that prefills the prompt."""

    request_id: int
    prompt: str | None
    params: SamplingParams
    samples: list[SampleState]
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def parent(self) -> Sequence:
        return self.samples[0].seq

    @property
    def done(self) -> bool:
        # why the count: samples 1..n-1 come only when the prompt is prefilled (none for max_tokens 0)
        forked = len(self.samples) == self.params.n or self.params.max_tokens == 0
        return forked and all(s.done for s in self.samples)

    def store_prompt_logprobs(self, start: int, scored: list[PositionLogprobs]) -> None:
        """Logprobs of prompt tokens start+1 .. start+len(scored), scored at positions start .. (rows)."""
        store = self.prompt_logprobs
        if store is None:
            return
        for j, entry in enumerate(scored):
            if store[start + j + 1] is None:  # why: a recomputation after preemption repeats positions
                store[start + j + 1] = entry

    def output(self) -> RequestOutput:
        completions = [s.completion() for s in self.samples]
        if self.params.max_tokens == 0:  # scoring only: n empty samples, none was forked
            completions = [dataclasses.replace(completions[0], index=i) for i in range(self.params.n)]
        if not self.params.detokenize:  # vLLM's token-ids-only request: no text in its logprobs either
            _drop_token_texts(self.prompt_logprobs, *(c.logprobs for c in completions))
        return RequestOutput(
            request_id=str(self.request_id),
            prompt=self.prompt,
            prompt_token_ids=self.parent.prompt_token_ids,
            outputs=completions,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.parent.num_cached_tokens,
        )


def _drop_token_texts(*positions: list[PositionLogprobs | None] | list[PositionLogprobs] | None) -> None:
    """Set every Logprob's decoded_token to None (each entry is this request's own object)."""
    for entries in positions:
        for entry in entries or []:
            for logprob in (entry or {}).values():
                logprob.decoded_token = None
