"""Engine: the step loop that ties scheduler, model runner, sampler and stop checks together.

Each step: the scheduler picks chunks and says what changed (a frozen ScheduledBatch) -> the
model runner applies the changes to its persistent state (sampling batch, decode rows) -> the
scheduler advances the computed counts -> a request with n > 1 whose prefill ends in this step
forks its other samples (the scheduler makes them; the runner hears of them at once, they draw
in this step) -> the draw's inputs are staged (sampling view, min_tokens masks, bans, grammar
bitmasks, prompt-logprob targets: loop/step_outputs) -> the runner uploads them with the
forward's metadata in one copy and runs the chunks in one forward -> raw logprobs are taken,
the sampler draws on the device, the chosen tokens are scored -> ONE read brings back ids, the
NaN flag and every logprob -> the runner's batch and the scheduler take the tokens -> stop
checks -> finished samples go through the scheduler (blocks released now; the runner hears of
them in the next update); a request whose samples are all finished becomes a RequestOutput.
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
from batchgen.engine.loop.step_outputs import PromptRows, StepOutputs, StepPlan, prompt_rows, read_outputs
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.sampling.batch import SamplingStep
from batchgen.engine.sampling.logprobs import TokenTexts, entries
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
        self._errors: list[RequestOutput] = []  # refused requests, reported by the next step()
        self._ids = itertools.count()
        if sampler.features is None:
            sampler.features = LogitsFeatures(tokenizer, vocab_size, self.eos_token_ids)
        runner.batch.features = sampler.features  # the runner's rows hold each request's feature state
        self._planned: StepPlan | None = None  # this step's plan, made inside runner.execute
        runner.before_upload = self._plan

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
        self.stats.count(batch)
        # why before the forward: forks need their parent's prompt counted, and what the draw needs
        # is staged before the runner's upload (a failed step aborts every request anyway)
        self.scheduler.advance(batch)
        logits = self.runner.execute(batch)  # applies batch.update, calls _plan before its upload
        plan, self._planned = self._planned, None
        if plan is None:
            raise RuntimeError("the model runner did not call the engine's before_upload hook")
        outputs = read_outputs(plan, logits, self.sampler, self.runner.transfers)
        if outputs is not None:
            self._check_nan(outputs.nan, plan.seq_ids or plan.sampled)
            if plan.prompt is not None and outputs.prompt is not None:
                self._store_prompt_logprobs(plan.prompt, outputs.prompt)
        for request in plan.ends:  # max_tokens 0: scored, never sampled
            request.forked = True
            self._finish_sample(request, request.samples[0], finished)
        if plan.step is not None and outputs is not None:
            self._accept(plan.seq_ids, plan.step, outputs, finished)
        self.stats.preemptions = self.scheduler.num_preemptions
        if not self.scheduler.has_unfinished():
            # why: the last finished sequences have no next step whose update would tell the runner
            self.runner.apply(self.scheduler.take_update())
        return finished

    def _plan(self, batch: ScheduledBatch) -> None:
        """The runner's before_upload hook (the step's diff applied, nothing uploaded yet): fork what
        must fork, and stage what the draw and the scoring need, so it rides in the step's upload."""
        sampled = batch.sampled
        seq_ids, rows, ends = self._expand(sampled)
        plan = StepPlan(sampled, seq_ids, rows, ends)
        if seq_ids:
            plan.step = self.runner.batch.step(seq_ids)  # the rows' sampling state, kept while the batch is unchanged
            self.sampler.prepare(plan.step)
        chunks = [(self.requests.get(c.seq_id)[0], c.start, c.prompt_logits) for c in batch.chunks if c.prompt_logits]
        plan.prompt = prompt_rows(chunks, self.runner.transfers)
        self._planned = plan

    def _accept(
        self, seq_ids: list[int], step: SamplingStep, outputs: StepOutputs, finished: list[RequestOutput]
    ) -> None:
        """The read tokens: state advances, logprobs are recorded, stop checks run."""
        tokens = outputs.tokens
        rows = self.runner.batch
        rows.accept(step, tokens)  # min_tokens counts, bad-word tails and grammar matchers advance
        self.scheduler.update_from_output(seq_ids, tokens)
        self.stats.output_tokens += len(tokens)
        taken = {}
        if step.logprobs is not None and outputs.logprobs is not None:
            asked = step.logprobs.rows
            chosen = [tokens[i] for i in asked]
            taken = dict(zip(asked, entries(outputs.logprobs, step.logprobs.ks, chosen, self.texts)))
        grammars = step.grammars  # why once: the loop runs per sequence
        lookup = self.requests.get
        for i, (seq_id, token) in enumerate(zip(seq_ids, tokens)):
            request, sample = lookup(seq_id)
            if taken and i in taken:
                sample.record(*taken[i])
            if sample.stop.append(token) or (grammars and rows.terminated(seq_id) and sample.stop.finish_now()):
                self._finish_sample(request, sample, finished)

    def _check_nan(self, flag: bool, seq_ids: list[int]) -> None:
        if flag:  # why: a NaN would be "sampled" into garbage silently; failing lets the job retry
            raise RuntimeError(f"NaN logits in step {self.stats.steps} (requests {seq_ids[:8]})")

    def _expand(self, sampled: list[int]) -> tuple[list[int], torch.Tensor | None, list[RequestState]]:
        """The rows to draw: a parent whose prefill ends now forks (its row serves all n samples);
        a max_tokens 0 request ends after the forward, unsampled. -> (seq ids, their logits rows
        staged (None: the sampled rows themselves), the requests to end)."""
        special = self.requests.special
        if not special or not any(s in special for s in sampled):
            return sampled, None, []
        rows: list[int] = []
        seq_ids: list[int] = []
        ends: list[RequestState] = []
        for i, seq_id in enumerate(sampled):
            request = special.pop(seq_id, None)
            if request is None:
                rows.append(i)
                seq_ids.append(seq_id)
            elif request.params.max_tokens == 0:
                ends.append(request)
            else:
                self._fork(request)
                rows.extend([i] * len(request.samples))
                seq_ids.extend(s.seq.seq_id for s in request.samples)
        self.runner.apply(self.scheduler.take_update())  # the forked samples draw in this step
        return seq_ids, self.runner.transfers.stage(torch.tensor(rows, dtype=torch.int64)), ends

    def _fork(self, request: RequestState) -> None:
        """Samples 1..n-1 of a request whose prompt is prefilled, sharing its KV blocks."""
        parent = request.parent
        for index in range(1, request.params.n):
            child = self.scheduler.fork(parent.seq_id, next(self._ids), fork_params(request.params, index))
            self.requests.add_sample(request, SampleState(index, child, self._stop_checker(child)))
        request.forked = True

    def _store_prompt_logprobs(self, prompt: PromptRows, read: list[list]) -> None:
        """The prompt rows' logprobs, as read, into their requests (rows in chunk order)."""
        scored = entries(read, prompt.ks, prompt.targets, self.texts)
        row = 0
        for request, start, count in prompt.chunks:
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
        self._planned = None

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
