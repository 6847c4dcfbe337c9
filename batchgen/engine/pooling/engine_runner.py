"""Pooling batches through batchgen's own engine, for decoder models: the LLM's scheduler and the
runner's packed forward (`pool_forward`) returning hidden states instead of logits.

Why not the generate loop: nothing is sampled or detokenized. A pooling prompt is a max_tokens 0
sequence of the LLM's own scheduler, so admission, chunking and preemption are generation's
rules (no prompt-only step preempts: a prompt is admitted only when all of it fits, after the
running ones took their chunks); its chunks' hidden states feed its PoolAccumulator, and it ends
in the step whose chunk completes its prompt (the batch's `ends`). Only last-token pooling reuses a cached prefix (mean
and CLS need the prefix positions' hidden states, which the cache does not hold).
"""

from __future__ import annotations

from collections.abc import Callable

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.sequence import RequestExtras, Sequence
from batchgen.engine.pooling.outputs import RowResult
from batchgen.engine.pooling.poolers import PoolAccumulator
from batchgen.engine.runner.model_runner import ModelRunner

_SCORED = SamplingParams(max_tokens=0)  # the scheduler ends it, unsampled, when its prompt is computed


class EnginePoolingRunner:
    """Runs pooling requests over a ModelRunner and its Scheduler (those of an LLM's engine)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler

    def pool(self, prompts: list[list[int]], method: str, on_step: Callable[[], None] | None = None) -> list[RowResult]:
        """Pooled hidden states [H] float32 of every prompt, in the given order (callers order by length).
        `on_step` runs after every forward (the job runner stops there on a signal)."""
        scheduler = self.scheduler
        results = [RowResult(None, error="not run")] * len(prompts)
        pooled: dict[int, tuple[int, PoolAccumulator]] = {}
        extras = RequestExtras(uncached=method != "last")
        for index, prompt in enumerate(prompts):
            seq = Sequence(scheduler.new_seq_id(), list(prompt), _SCORED, extras=extras)
            why = scheduler.check_fits(seq)
            if why is not None:
                results[index] = RowResult(None, error=why)
                continue
            scheduler.add(seq)
            pooled[seq.seq_id] = (index, PoolAccumulator(method, seq.num_tokens))
        try:
            while scheduler.has_unfinished():
                batch = scheduler.schedule()
                hidden, ends = self.runner.pool_forward(batch)  # [T, H], each chunk's end in the packed row
                for chunk, end in zip(batch.chunks, ends):
                    pooled[chunk.seq_id][1].add(chunk.start, hidden[end - chunk.num_tokens : end])
                for seq_id in batch.ends:
                    index, acc = pooled.pop(seq_id)
                    cached = scheduler.get(seq_id).num_cached_tokens
                    results[index] = RowResult(acc.result().cpu(), cached)  # [H] float32 on the host
                    scheduler.finish(seq_id)
                if on_step is not None:
                    on_step()
        except BaseException:
            # why everything: a failed forward may have left blocks registered with K/V never written
            scheduler.drop_all()
            self.runner.drop_all()
            raise
        self.runner.apply(scheduler.take_update())  # the last finished sequences have no next step
        return results
