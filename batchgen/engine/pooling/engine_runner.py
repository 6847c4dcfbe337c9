"""Pooling batches through batchgen's own engine, for decoder models: the runner's packed forward
(`pool_forward`) returning hidden states instead of logits.

Why not the generate loop: nothing is sampled. Admission is the scheduler's own rule
(core/scheduler.admit_prompt), with the blocks running sequences still need held back (pooling
never preempts). Its Sequences are its own. Only last-token pooling reuses a cached prefix (mean
and CLS need the prefix positions' hidden states, which the cache does not hold).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.scheduler import admit_prompt
from batchgen.engine.core.scheduler_output import ScheduledChunk
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.pooling.poolers import PoolAccumulator
from batchgen.engine.runner.model_runner import ModelRunner


@dataclass
class PooledResult:
    """One prompt's pooled vector [H] float32 (None: it could not run, `error` says why)."""

    vector: torch.Tensor | None
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class _Running:
    index: int  # the prompt's position in the caller's list
    seq: Sequence
    acc: PoolAccumulator
    cached: int


class EnginePoolingRunner:
    """Runs pooling requests over a ModelRunner and its BlockManager (those of an LLM's engine)."""

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, token_budget: int, max_num_seqs: int) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.token_budget = token_budget
        self.max_num_seqs = max_num_seqs
        self._ids = itertools.count(1 << 40)  # why far off: never an id the generate loop hands out
        self._params = SamplingParams(max_tokens=0)

    def pool(
        self, prompts: list[list[int]], method: str, on_step: Callable[[], None] | None = None
    ) -> list[PooledResult]:
        """Pooled hidden states of every prompt, in the given order (callers order by length).
        `on_step` runs after every forward (the job runner stops there on a signal)."""
        results: list[PooledResult | None] = [None] * len(prompts)
        waiting = deque(range(len(prompts)))
        running: list[_Running] = []
        done = False
        try:
            while waiting or running:
                chunks = self._schedule(prompts, method, waiting, running, results)
                if not chunks and running:
                    raise RuntimeError("pooling: no running sequence could be scheduled (KV pool exhausted)")
                if chunks:
                    self._run(chunks, running)
                for r in [r for r in running if r.seq.num_computed_tokens == r.seq.num_tokens]:
                    results[r.index] = PooledResult(r.acc.result().cpu(), r.cached)  # [H] float32 on the host
                    self._release(r)
                    running.remove(r)
                if on_step is not None:
                    on_step()
            done = True
        finally:
            for r in running:  # an aborted batch gives its blocks back
                self._release(r)
            if not done:  # why: a failed forward may have left blocks registered with K/V never written
                self.block_manager.reset_prefix_cache()
        return [r if r is not None else PooledResult(None, error="not run") for r in results]

    def _schedule(
        self,
        prompts: list[list[int]],
        method: str,
        waiting: deque[int],
        running: list[_Running],
        results: list[PooledResult | None],
    ) -> list[tuple[_Running, int]]:
        """This step's (sequence, tokens) chunks: running sequences' next chunks, then new ones."""
        bm, budget = self.block_manager, self.token_budget
        chunks: list[tuple[_Running, int]] = []
        for r in running:
            n = min(r.seq.num_tokens - r.seq.num_computed_tokens, budget)
            if n > 0 and bm.allocate_slots(r.seq, n):  # its whole prompt was promised at admission
                chunks.append((r, n))
                budget -= n
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            index = waiting[0]
            seq = Sequence(next(self._ids), list(prompts[index]), self._params)
            admitted = admit_prompt(bm, seq, budget, use_cache=method == "last", reserve=self._promised(running))
            if admitted is None:
                if running or chunks:
                    break  # wait for running sequences to free blocks (FCFS: nobody overtakes)
                waiting.popleft()
                results[index] = PooledResult(None, error=f"prompt of {seq.num_tokens} tokens does not fit the KV pool")
                continue
            waiting.popleft()
            r = _Running(index, seq, PoolAccumulator(method, seq.num_tokens), seq.num_computed_tokens)
            running.append(r)
            chunks.append((r, admitted))
            budget -= admitted
        return chunks

    def _promised(self, running: list[_Running]) -> int:
        """Blocks running sequences still need for their later chunks (held back: no running
        sequence ever waits on a block, since pooling never preempts)."""
        bm = self.block_manager
        return sum(bm.blocks_needed(r.seq.num_tokens) - len(bm.block_table(r.seq.seq_id)) for r in running)

    def _run(self, scheduled: list[tuple[_Running, int]], running: list[_Running]) -> None:
        """One packed forward of the chunks; each chunk's hidden states go to its accumulator."""
        snapshots = []
        for r, n in scheduled:
            start = r.seq.num_computed_tokens
            table = tuple(self.block_manager.block_table(r.seq.seq_id))
            ids = tuple(r.seq.token_ids[start : start + n])
            done = start + n == r.seq.num_tokens
            snapshots.append(ScheduledChunk(r.seq.seq_id, start, ids, table, done, False, 0, r.seq.num_tokens))
        hidden, ends = self.runner.pool_forward(snapshots)  # [T, H], each chunk's end in the packed row
        for (r, n), end in zip(scheduled, ends):
            r.acc.add(r.seq.num_computed_tokens, hidden[end - n : end])
            r.seq.num_computed_tokens += n

    def _release(self, r: _Running) -> None:
        """Blocks back to the pool (their hashes stay for reuse), the backend's rows too."""
        self.block_manager.free(r.seq.seq_id)
        self.runner.release([r.seq.seq_id])
