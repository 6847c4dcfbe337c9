"""Engine: the step loop that ties scheduler, model runner, sampler and stop checks together.

Each step: the scheduler picks chunks and says what changed (a frozen ScheduledBatch) -> the
model runner applies the changes to its persistent state (sampling batch, decode rows) and runs
the chunks in one forward -> the scheduler advances the computed counts -> prompt logprobs are
taken -> a request with n > 1 whose prefill just ended forks its other samples (the scheduler
makes them; the runner hears of them at once, they draw in this step) -> logprobs of the raw
logits are taken -> the sampler picks a token for every sample that needs one, reading the
runner's sampling batch -> the scheduler appends the tokens -> stop checks -> finished samples
go through the scheduler (blocks released now; the runner hears of them in the next update);
a request whose samples are all finished becomes a RequestOutput.
A request that can never fit becomes an "error" output on its own. When `generate()` fails,
every owner drops its whole state at once (abort_all), so the engine can be used again.

State: the scheduler owns sequences (progress, status, blocks), the runner its persistent
batch, and this engine only the output side (RequestTable: texts, stop checks, logprobs).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.scheduler import ScheduledBatch, Scheduler
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.loop.generate_loop import run_to_completion
from batchgen.engine.loop.requests import RequestState, RequestTable, SampleState, fork_params
from batchgen.engine.loop.stats import EngineStats
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.sampling.logprobs import TokenTexts, take_logprobs
from batchgen.engine.sampling.penalties import LogitsFeatures
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sampling.stopping import StopChecker

logger = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        sampler: Sampler,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.vocab_size = vocab_size
        self.stats = EngineStats()
        self.texts = TokenTexts(tokenizer)
        self.requests = RequestTable()
        sampler.transfers = runner.transfers
        self._errors: list[RequestOutput] = []  # refused requests, reported by the next step()
        self._ids = itertools.count()
        if sampler.features is None:
            sampler.features = LogitsFeatures(tokenizer, vocab_size, self.eos_token_ids)
        runner.batch.features = sampler.features  # the runner's rows hold each request's feature state

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None) -> int:
        """Queue one request; returns its id. One that can never fit is answered with an error output."""
        request_id = next(self._ids)
        self.stats.requests += 1
        params = self._resolve_max_tokens(params, len(prompt_token_ids))
        seq = Sequence(request_id, list(prompt_token_ids), params)
        message = self._check_token_ids(seq) or self.scheduler.check_fits(seq)
        if message is None and params.uses_logits_features:
            message = self.sampler.features.check(request_id, params)  # type: ignore[union-attr]  # set in __init__
        if message is None:
            try:
                self.scheduler.add(seq)
            except ValueError as exc:
                message = str(exc)
        if message is not None:
            logger.warning("refusing %s", message)  # the message starts "request N:"
            self.stats.errors += 1
            self._errors.append(RequestOutput(str(request_id), prompt, seq.prompt_token_ids, error=message))
            return request_id
        sample = SampleState(0, seq, self._stop_checker(seq))
        wants_prompt = params.prompt_logprobs is not None
        request = RequestState(
            request_id,
            prompt,
            params,
            [sample],
            prompt_logprobs=[None] * seq.num_prompt_tokens if wants_prompt else None,
            forked=params.n == 1,
        )
        self.requests.add(request)
        return request_id

    def _resolve_max_tokens(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        """max_tokens None: up to the context (at least 1, so a full prompt fails as too long)."""
        if params.max_tokens is not None:
            return params
        room = max(1, self.scheduler.max_model_len - num_prompt_tokens)
        return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))

    def _stop_checker(self, seq: Sequence) -> StopChecker:
        return StopChecker(self.tokenizer, seq.params, self.eos_token_ids, seq.prompt_token_ids)

    def _check_token_ids(self, seq: Sequence) -> str | None:
        # why: an id past the embedding table would crash the whole batch's forward (on CUDA, the process)
        bad = [t for t in seq.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"request {seq.seq_id}: prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
        return None

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
                f"the scheduler scheduled nothing with {self.scheduler.num_waiting} waiting and "
                f"{self.scheduler.num_running} running sequences"
            )
        sampled = batch.sampled
        self.stats.count(batch)
        logits = self.runner.execute(batch)  # [len(sampled) + prompt-logprob rows, vocab]; applies batch.update
        self.scheduler.advance(batch)
        if logits.shape[0] > len(sampled):
            self._take_prompt_logprobs(batch, logits[len(sampled) :])
        rows = logits[: len(sampled)]
        seq_ids, kept = self._expand(sampled, rows, finished)
        # the NaN check covers every row; the sampler's own check covers the rows it is given
        sampler_sees_all = bool(seq_ids) and kept is rows and len(sampled) == logits.shape[0]
        nan = None
        if logits.shape[0] and not sampler_sees_all:
            nan = logits.amax().isnan()  # why amax: it propagates NaN, ~10x faster than isnan().any() on CPU
        if seq_ids:
            self._sample(seq_ids, kept, nan, finished)
        elif nan is not None:  # prompt-logprob rows only: their own read
            self._check_nan(self.runner.transfers.read("nan_flag", nan)[0][0], sampled)
        self.stats.preemptions = self.scheduler.num_preemptions
        if not self.scheduler.has_unfinished():
            # why: the last finished sequences have no next step whose update would tell the runner
            self.runner.apply(self.scheduler.take_update())
        return finished

    def _sample(
        self, seq_ids: list[int], logits: torch.Tensor, nan: torch.Tensor | None, finished: list[RequestOutput]
    ) -> None:
        """Draw one token per row, with its raw logprobs when asked, and run the stop checks.
        `nan`: the step's NaN flag, None when `logits` are all its rows (the sampler's flag then)."""
        rows = self.runner.batch
        step = rows.step(seq_ids)  # the rows' sampling state, cached while the batch is unchanged
        # why before the sampler: logprobs are of the raw distribution, whatever the sampler does
        pending = take_logprobs(logits, step.logprobs) if step.logprobs is not None else None
        if nan is None:
            ids, nan = self.sampler.sample_ids_and_nan(logits, step)
        else:
            ids = self.sampler.sample_ids(logits, step)
        # why one read: the NaN flag comes back with the sampled ids, one host sync per step
        tokens, flag = self.runner.transfers.read("sampled_ids", ids, nan)
        self._check_nan(flag[0], seq_ids)
        rows.accept(step, tokens)  # penalty counts and grammar matchers advance on the same read
        self.scheduler.update_from_output(seq_ids, tokens)
        self.stats.output_tokens += len(tokens)
        taken = {}
        if pending is not None:
            taken = dict(zip(pending.rows, pending.resolve([tokens[i] for i in pending.rows], self.texts)))
        grammars = step.grammars  # why once: the loop runs per sequence
        lookup = self.requests.get
        for i, (seq_id, token) in enumerate(zip(seq_ids, tokens)):
            request, sample = lookup(seq_id)
            if taken and i in taken:
                sample.record(*taken[i])
            if sample.stop.append(token) or (grammars and rows.terminated(seq_id) and sample.stop.finish_now()):
                self._finish_sample(request, sample, finished)

    def _check_nan(self, flag: int, seq_ids: list[int]) -> None:
        if flag:  # why: a NaN would be "sampled" into garbage silently; failing lets the job retry
            raise RuntimeError(f"NaN logits in step {self.stats.steps} (requests {seq_ids[:8]})")

    def _expand(
        self, sampled: list[int], logits: torch.Tensor, finished: list[RequestOutput]
    ) -> tuple[list[int], torch.Tensor]:
        """The rows to sample: a parent whose prefill ended forks (its row serves all n samples);
        a max_tokens 0 request ends here, unsampled."""
        special = self.requests.special
        if not special or not any(s in special for s in sampled):
            return sampled, logits
        rows: list[int] = []
        seq_ids: list[int] = []
        for i, seq_id in enumerate(sampled):
            request = special.pop(seq_id, None)
            if request is None:
                rows.append(i)
                seq_ids.append(seq_id)
            elif request.params.max_tokens == 0:
                request.forked = True
                self._finish_sample(request, request.samples[0], finished)
            else:
                self._fork(request)
                rows.extend([i] * len(request.samples))
                seq_ids.extend(s.seq.seq_id for s in request.samples)
        self.runner.apply(self.scheduler.take_update())  # the forked samples draw in this step
        return seq_ids, logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))

    def _fork(self, request: RequestState) -> None:
        """Samples 1..n-1 of a request whose prompt is prefilled, sharing its KV blocks."""
        parent = request.parent
        for index in range(1, request.params.n):
            child = self.scheduler.fork(parent.seq_id, next(self._ids), fork_params(request.params, index))
            self.requests.add_sample(request, SampleState(index, child, self._stop_checker(child)))
        request.forked = True

    def _take_prompt_logprobs(self, batch: ScheduledBatch, logits: torch.Tensor) -> None:
        """Logprobs of the prompt tokens whose predicting positions ran in this step (rows in chunk order)."""
        row = 0
        for chunk in batch.chunks:
            if chunk.prompt_logits:
                request, _ = self.requests.get(chunk.seq_id)
                request.store_prompt_logprobs(chunk.start, logits[row : row + chunk.prompt_logits], self.texts)
                row += chunk.prompt_logits

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
        if self.requests.finish_sample(request, sample):
            self.stats.cached_tokens += request.parent.num_cached_tokens
            finished.append(request.output())

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
        texts: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in input order, `on_output` as each one finishes.

        Each output's `request_id` is its index in `prompts` (as a string); `texts` are the
        prompts' texts for the outputs' `prompt` (None: not given as text).
        """
        if len(prompts) != len(params):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        try:
            return run_to_completion(self, prompts, params, on_output, texts or [None] * len(prompts))
        except BaseException:
            # why BaseException: a KeyboardInterrupt mid-step orphans requests just the same
            self.abort_all()
            raise
