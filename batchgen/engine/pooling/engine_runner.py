"""Pooling batches through batchgen's own engine, for the decoder models it runs: packed varlen
forwards (every scheduled chunk of every sequence in one [1, T] row, no padding), the paged KV
pool and the attention backend of the generate path, returning the base model's hidden states
instead of logits.

Why not the generate loop: a pooling request samples nothing, so it needs no sampler, stop checks
or decode steps; what it shares with generation is admission under a token budget and the KV
block pool (chunked prefill of long prompts, prefix reuse), and the model runner's attention path.
The admission rule is the scheduler's (`_schedule_waiting`): match the cached prefix, admit only
when the whole remaining prompt fits the pool, allocate chunk by chunk. Its Sequences are its
own (never in the scheduler's queues), so it is their one writer, as the scheduler is of its own.

Prefix cache: last-token pooling over a causal model needs only the last position's hidden
state, and a cached prefix's K/V is exactly what that position attends to, so a shared prefix is
reused (and counted as cached tokens). Mean and CLS pooling need hidden states of the prefix
positions themselves, which the cache does not hold: they recompute every token.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention.planning import int64_tensor
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.scheduler_output import ScheduledChunk
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.pooling.poolers import PoolAccumulator
from batchgen.engine.runner.model_runner import ModelRunner, pack_chunks


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
        self.base_model = runner.model.base_model  # the decoder stack without its LM head
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
            computed, cached = bm.get_computed_blocks(seq) if method == "last" else ([], 0)
            remaining = seq.num_tokens - cached
            if not self._fits(seq, remaining, computed, running):
                if running or chunks:
                    break  # wait for running sequences to free blocks (FCFS: nobody overtakes)
                waiting.popleft()
                results[index] = PooledResult(None, error=f"prompt of {seq.num_tokens} tokens does not fit the KV pool")
                continue
            n = min(remaining, budget)
            bm.allocate_slots(seq, n, computed)
            waiting.popleft()
            seq.num_computed_tokens = cached
            r = _Running(index, seq, PoolAccumulator(method, seq.num_tokens), cached)
            running.append(r)
            chunks.append((r, n))
            budget -= n
        return chunks

    def _fits(self, seq: Sequence, remaining: int, computed: list[int], running: list[_Running]) -> bool:
        """Whether `seq`'s whole remaining prompt fits now, leaving the blocks running sequences
        still need for their later chunks (so no running sequence ever waits on a block)."""
        bm = self.block_manager
        promised = sum(bm.blocks_needed(r.seq.num_tokens) - len(bm.block_table(r.seq.seq_id)) for r in running)
        fresh = bm.blocks_needed(seq.num_tokens) - len(computed)
        return bm.can_allocate(seq, remaining, computed) and fresh + promised <= bm.num_free_blocks

    def _run(self, scheduled: list[tuple[_Running, int]], running: list[_Running]) -> None:
        """One packed forward of the chunks; each chunk's hidden states go to its accumulator."""
        snapshots = []
        for r, n in scheduled:
            start = r.seq.num_computed_tokens
            table = tuple(self.block_manager.block_table(r.seq.seq_id))
            ids = tuple(r.seq.token_ids[start : start + n])
            done = start + n == r.seq.num_tokens
            snapshots.append(ScheduledChunk(r.seq.seq_id, start, ids, table, done, False, 0, r.seq.num_tokens))
        hidden, ends = self._forward(snapshots)  # [T, H], each chunk's end in the packed row
        for (r, n), end in zip(scheduled, ends):
            r.acc.add(r.seq.num_computed_tokens, hidden[end - n : end])
            r.seq.num_computed_tokens += n

    def _forward(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[int]]:
        """The base model over the packed chunks -> (hidden states [T, H], each chunk's packed end)."""
        runner = self.runner
        runner.step_hook.tick()
        runner.transfers.begin_step()
        ctx, positions, order = runner.backend.plan(chunks, runner.transfers, None)
        token_ids, ends = pack_chunks(chunks, order)
        input_ids = runner.transfers.stage(int64_tensor(token_ids))  # [T]
        runner.transfers.upload()
        with torch.inference_mode(), runner.backend.running(ctx):
            out = self.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        runner.check_attention_calls(ctx)
        return out.last_hidden_state[0], ends  # [T, H]

    def _release(self, r: _Running) -> None:
        """Blocks back to the pool (their hashes stay for reuse), the backend's rows too."""
        self.block_manager.free(r.seq.seq_id)
        self.runner.backend.release([r.seq.seq_id])
