"""Engine: the step loop that ties the scheduler, the model runner and the output side together.

Each step is one straight road (vLLM v1): the scheduler decides everything the step needs and
hands it down as one frozen ScheduledBatch (the chunks, what changed, who draws from which logits
row: a request with n > 1 forks inside `schedule()` when its prompt ends, its samples sharing the
prompt's blocks and row) -> the model runner executes it in one call (its state updated from the
batch's diff, one upload, one forward, the sampler's draw, ONE read) and returns a
ModelRunnerOutput (drawn ids, logprobs, the NaN flag, prompt logprobs) -> the scheduler takes the
tokens -> stop checks -> finished samples go through the scheduler (blocks released now; the
runner hears of them in the next batch); a request whose samples are all finished becomes a
RequestOutput. Nothing below this loop calls back into it. A request that can never fit becomes
an "error" output on its own. When `generate()` fails, every owner drops its whole state at once
(abort_all), so the engine can be used again.

State: the scheduler owns sequences (progress, status, blocks), the runner its persistent batch
and the sampler, and this engine only the output side (a RequestState per request, by sample: texts,
stop checks, logprobs) and its counters (EngineStats, for benchmarks and the job's logs).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from batchgen.engine.api.outputs import PositionLogprobs, RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.api.prompts import outside_vocabulary
from batchgen.engine.core.runner_output import LogprobLists, ModelRunnerOutput
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.scheduler_output import ScheduledBatch
from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras, Sequence
from batchgen.engine.loop.requests import RequestState, SampleState
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.sampling.logprobs import entries
from batchgen.engine.sampling.stopping import StopChecker

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters a benchmark can read. Token counts are tokens run through the model."""

    steps: int = 0
    requests: int = 0
    errors: int = 0
    prefill_tokens: int = 0  # prompt chunks, and recomputation after preemption
    decode_tokens: int = 0  # decode chunks (ScheduledChunk.is_decode): one new token each
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, over finished requests
    output_tokens: int = 0  # sampled tokens
    preemptions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def count(self, batch: ScheduledBatch) -> None:
        """One step ran `batch`."""
        self.steps += 1
        for chunk in batch.chunks:
            if chunk.is_decode:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += chunk.num_tokens


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.vocab_size = vocab_size
        self.stats = EngineStats()
        # each token id's own text (vLLM's `decoded_token`), decoded once
        self.texts = functools.cache(lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
        self.requests: dict[int, tuple[RequestState, SampleState]] = {}  # by each unfinished sample's seq id
        self._errors: list[RequestOutput] = []  # refused requests, reported by the next step()

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        extras: RequestExtras = NO_EXTRAS,
        refusal: str | None = None,
    ) -> int:
        """Queue one request (`extras`: its adapter, its images); returns its id. One that can
        never fit, or comes with a `refusal` (its adapter could not be loaded), is answered with
        an error output."""
        request_id = self.scheduler.new_seq_id()
        self.stats.requests += 1
        if params.max_tokens is None:  # up to the context (at least 1, so a full prompt fails as too long)
            room = max(1, self.scheduler.max_model_len - len(prompt_token_ids))
            params = dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        seq = Sequence(request_id, list(prompt_token_ids), params, extras=extras)
        refusal = refusal or outside_vocabulary(seq.prompt_token_ids, self.vocab_size)
        message = f"request {request_id}: {refusal}" if refusal is not None else None
        message = message or self.scheduler.check_fits(seq)
        message = message or self.runner.check_request(request_id, params)
        if message is not None:
            logger.warning("refusing %s", message)  # the message starts "request N:"
            self.stats.errors += 1
            self._errors.append(RequestOutput(str(request_id), prompt, seq.prompt_token_ids, error=message))
            return request_id
        self.scheduler.add(seq)
        scored: list[PositionLogprobs | None] | None = None  # the prompt's logprobs, when asked
        if params.prompt_logprobs is not None:
            scored = [None] * seq.num_prompt_tokens
        first = SampleState(0, seq, self._stop_checker(seq))
        self.requests[request_id] = (RequestState(request_id, prompt, params, [first], scored), first)
        return request_id

    def _stop_checker(self, seq: Sequence) -> StopChecker:
        return StopChecker(self.tokenizer, seq.params, self.eos_token_ids, seq.prompt_token_ids)

    def has_unfinished(self) -> bool:
        return bool(self._errors) or self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the requests that finished in it."""
        finished, self._errors = self._errors, []
        if not self.scheduler.has_unfinished():
            return finished
        batch = self.scheduler.schedule()
        if not batch.chunks:
            raise RuntimeError(
                f"the scheduler scheduled nothing with {len(self.scheduler.waiting)} waiting and "
                f"{len(self.scheduler.running)} running sequences"
            )
        self.stats.count(batch)
        for parent, children in batch.forks:
            self._add_samples(parent, children)
        out = self.runner.execute(batch)
        failed = self._fail(out.errors, finished) if out.errors else frozenset()
        if out.nan:  # why: a NaN would be "sampled" into garbage silently; failing lets the job retry
            raise RuntimeError(f"NaN logits in step {self.stats.steps} (requests {batch.seq_ids[:8]})")
        if out.prompt_logprobs is not None:
            self._store_prompt_logprobs(out.prompt_logprobs)
        for seq_id in batch.ends:  # max_tokens 0: scored, never sampled
            request, sample = self.requests[seq_id]
            self._finish_sample(request, sample, finished)
        if batch.draws:
            self._accept(batch, out, finished, failed)
        self.stats.preemptions = self.scheduler.num_preemptions
        if not self.scheduler.has_unfinished():
            # why: the last finished sequences have no next step whose batch would tell the runner
            self.runner.apply(self.scheduler.take_update())
        return finished

    def _accept(
        self,
        batch: ScheduledBatch,
        out: ModelRunnerOutput,
        finished: list[RequestOutput],
        failed: frozenset[int] = frozenset(),
    ) -> None:
        """The drawn tokens: the scheduler takes them, logprobs are recorded, stop checks run
        (`failed`: sequences already ended with an error in this step, skipped)."""
        seq_ids, tokens = batch.draws, out.sampled
        if failed:
            kept = [(s, t) for s, t in zip(seq_ids, tokens) if s not in failed]
            self.scheduler.update_from_output([s for s, _ in kept], [t for _, t in kept])
        else:
            self.scheduler.update_from_output(seq_ids, tokens)
        self.stats.output_tokens += len(tokens)
        taken = {}
        if out.logprobs is not None:
            lp = out.logprobs
            taken = dict(zip(lp.rows, entries(lp.read, lp.ks, lp.targets, self.texts)))
        done = out.grammar_done  # why once: the loop runs per sequence
        requests = self.requests
        for i, (seq_id, token) in enumerate(zip(seq_ids, tokens)):
            if seq_id in failed:
                continue
            request, sample = requests[seq_id]
            if taken and i in taken:
                sample.record(*taken[i])
            if sample.stop.append(token) or (done and seq_id in done and sample.stop.finish_now()):
                self._finish_sample(request, sample, finished)

    def _fail(self, errors: tuple[tuple[int, str], ...], finished: list[RequestOutput]) -> frozenset[int]:
        """Requests the runner could not serve (an image that cannot be decoded): each ends now,
        all its samples with it, as an error output. -> the sequences ended."""
        ended: set[int] = set()
        for seq_id, message in errors:
            if seq_id in ended:
                continue
            request, _ = self.requests[seq_id]
            for sample in request.samples:
                ended.add(sample.seq.seq_id)
                self.scheduler.finish(sample.seq.seq_id)
                self.requests.pop(sample.seq.seq_id, None)
            self.stats.errors += 1
            error = f"request {request.request_id}: {message}"
            logger.warning("failing %s", error)
            finished.append(
                RequestOutput(str(request.request_id), request.prompt, request.parent.prompt_token_ids, error=error)
            )
        return frozenset(ended)

    def _add_samples(self, parent: int, children: tuple[int, ...]) -> None:
        """Samples 1..n-1 of a request, forked by the scheduler from its just-prefilled prompt."""
        request, _ = self.requests[parent]
        for index, child_id in enumerate(children, start=1):
            child = self.scheduler.get(child_id)
            request.samples.append(SampleState(index, child, self._stop_checker(child)))
            self.requests[child_id] = (request, request.samples[-1])

    def _store_prompt_logprobs(self, prompt: LogprobLists) -> None:
        """The prompt rows' logprobs, as read, into their requests (rows in chunk order)."""
        scored = entries(prompt.read, prompt.ks, prompt.targets, self.texts)
        row = 0
        for seq_id, start, count in prompt.chunks:
            request, _ = self.requests[seq_id]
            request.store_prompt_logprobs(start, [entry for entry, _ in scored[row : row + count]])
            row += count

    def abort_all(self) -> None:
        """Drop every unfinished request (queued or running) and what it holds, reporting none of them.

        Each owner drops its whole state: the scheduler its queues and the block pool (the prefix
        cache too), the runner its persistent batch, decode rows and K/V, and this engine its
        output side. Why everything, and the prefix cache too: a failed step may have been half
        run, so the K/V it wrote (and any block registered for it) cannot be trusted, and its
        requests' counts no longer match the cache.
        """
        dropped = self.scheduler.drop_all()
        if dropped:
            logger.warning("aborted %d unfinished requests", dropped)
        self.runner.drop_all()
        self.requests.clear()
        self._errors.clear()

    def _finish_sample(self, request: RequestState, sample: SampleState, finished: list[RequestOutput]) -> None:
        """A sample is done: the scheduler finishes its sequence; the request's last one makes the output."""
        self.scheduler.finish(sample.seq.seq_id)
        sample.done = True
        del self.requests[sample.seq.seq_id]
        if request.done:
            self.stats.cached_tokens += request.parent.num_cached_tokens
            finished.append(request.output())

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
        texts: list[str | None] | None = None,
        extras: list[RequestExtras] | None = None,
        refusals: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in input order, `on_output` as each one finishes.

        Each output's `request_id` is its index in `prompts` (as a string); `texts` are the
        prompts' texts for the outputs' `prompt` (None: not given as text); `extras` each
        request's adapter (engine/lora) and images (engine/vision), `refusals` why a request
        cannot run (its error output).
        """
        if len(prompts) != len(params):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        n = len(prompts)
        requests = zip(
            prompts, params, texts or [None] * n, extras or [NO_EXTRAS] * n, refusals or [None] * n, strict=True
        )
        results: list[RequestOutput | None] = [None] * n
        try:
            position = {str(self.add_request(*request)): i for i, request in enumerate(requests)}
            while self.has_unfinished():
                for output in self.step():
                    index = position.get(output.request_id)
                    if index is None:
                        continue  # a request added outside this call
                    output.request_id = str(index)
                    results[index] = output
                    if on_output is not None:
                        on_output(output)
        except BaseException:
            # why BaseException: a KeyboardInterrupt mid-step orphans requests just the same
            self.abort_all()
            raise
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"the engine stopped with requests {missing[:10]} unanswered")
        return results  # type: ignore[return-value]
