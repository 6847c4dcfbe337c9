"""Engine: the step loop that ties scheduler, model runner, sampler and stop checks together.

Each step: the scheduler picks chunks (a frozen snapshot) -> the model runner runs them in one
forward -> the scheduler advances the computed counts -> the sampler picks a token for every
chunk that needs one -> stop checks -> finished requests release their blocks and become
RequestOutputs. A request that can never fit becomes an "error" output on its own. When
`generate()` fails, every unfinished request is aborted, so the engine can be used again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from batchgen.engine.model_runner import ModelRunner
from batchgen.engine.outputs import RequestOutput
from batchgen.engine.params import SamplingParams
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import ScheduledBatch, Scheduler
from batchgen.engine.sequence import Sequence
from batchgen.engine.stopping import StopChecker

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters a benchmark can read. Token counts are tokens run through the model."""

    steps: int = 0
    requests: int = 0
    errors: int = 0
    prefill_tokens: int = 0  # prompt chunks, and recomputation after preemption
    decode_tokens: int = 0  # decode chunks (scheduler.is_decode): one new token each
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, over finished requests
    output_tokens: int = 0  # sampled tokens
    preemptions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Request:
    seq: Sequence
    stop: StopChecker


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
        sampler.transfers = runner.transfers
        self._requests: dict[int, _Request] = {}
        self._errors: list[RequestOutput] = []  # refused requests, reported by the next step()
        self._ids = itertools.count()

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Queue one request; returns its id. One that can never fit is answered with an error output."""
        request_id = next(self._ids)
        self.stats.requests += 1
        seq = Sequence(request_id, list(prompt_token_ids), params)
        message = self._check_token_ids(seq) or self.scheduler.check_fits(seq)
        if message is None:
            try:
                self.scheduler.add(seq)
            except ValueError as exc:
                message = str(exc)
        if message is not None:
            logger.warning("refusing request %d: %s", request_id, message)
            self.stats.errors += 1
            self._errors.append(RequestOutput(request_id, seq.prompt_token_ids, error=message))
            return request_id
        stop = StopChecker(self.tokenizer, params, self.eos_token_ids, seq.prompt_token_ids)
        self._requests[request_id] = _Request(seq, stop)
        return request_id

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
        if not batch.seqs:
            raise RuntimeError(
                f"the scheduler scheduled nothing with {self.scheduler.num_waiting} waiting and "
                f"{self.scheduler.num_running} running sequences"
            )
        sampled = batch.sampled
        self._count(batch)
        logits = self.runner.execute(batch)  # [len(sampled), vocab]
        tokens: list[int] = []
        if sampled:
            # why one read: the NaN flag comes back with the sampled ids, one host sync per step
            ids = self.sampler.sample_ids(logits, sampled)
            tokens, nan = self.runner.transfers.read("sampled_ids", ids, logits.isnan().any())
            if nan[0]:
                # why: a NaN would be "sampled" into garbage silently; failing lets the job retry
                seqs = [s.seq_id for s in sampled][:8]
                raise RuntimeError(f"NaN logits in step {self.stats.steps} (requests {seqs})")
        self.scheduler.advance(batch)
        if sampled:
            self.stats.output_tokens += len(tokens)
            for seq, token in zip(sampled, tokens):
                seq.append_token(token)
                request = self._requests[seq.seq_id]
                if request.stop.append(token):
                    finished.append(self._finish(request))
        self.stats.preemptions = self.scheduler.num_preemptions
        return finished

    def _count(self, batch: ScheduledBatch) -> None:
        self.stats.steps += 1
        for chunk in batch.chunks:
            if chunk.is_decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += chunk.num_tokens

    def abort_all(self) -> None:
        """Drop every unfinished request (queued or running) and what it holds, reporting none of them.

        Why everything, and the prefix cache too: a failed step may have been half run, so the
        K/V it wrote (and any block registered for it) cannot be trusted, and its requests'
        counts no longer match the cache.
        """
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in seqs:
            self.scheduler.finish(seq)
        for seq_id in self._requests:
            self.sampler.release(seq_id)
        if seqs:
            logger.warning("aborted %d unfinished requests", len(seqs))
        self._requests.clear()
        self._errors.clear()
        self.scheduler.block_manager.reset_prefix_cache()
        self.runner.reset()

    def _finish(self, request: _Request) -> RequestOutput:
        seq, stop = request.seq, request.stop
        self.scheduler.finish(seq)
        self.sampler.release(seq.seq_id)
        del self._requests[seq.seq_id]
        self.stats.cached_tokens += seq.num_cached_tokens
        return RequestOutput(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            text=stop.text,
            token_ids=seq.output_token_ids,
            finish_reason=stop.finish_reason,  # type: ignore[arg-type]  # set: _finish follows a stop
            stop_reason=stop.stop_reason,
            num_cached_tokens=seq.num_cached_tokens,
        )

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in input order, `on_output` as each one finishes.

        Each output's `request_id` is its index in `prompts`.
        """
        if len(prompts) != len(params):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        try:
            return self._run(prompts, params, on_output)
        except BaseException:
            # why BaseException: a KeyboardInterrupt mid-step orphans requests just the same
            self.abort_all()
            raise

    def _run(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_output: Callable[[RequestOutput], None] | None,
    ) -> list[RequestOutput]:
        position = {self.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, params))}
        results: list[RequestOutput | None] = [None] * len(prompts)
        while self.has_unfinished():
            for output in self.step():
                index = position.get(output.request_id)
                if index is None:
                    continue  # a request added outside this call
                output.request_id = index
                results[index] = output
                if on_output is not None:
                    on_output(output)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"the engine stopped with requests {missing[:10]} unanswered")
        return results  # type: ignore[return-value]
