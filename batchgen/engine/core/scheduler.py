"""Scheduler: token-budget continuous batching with chunked prefill and preemption.

One rule for prefill and decode (vLLM v1): each sequence's `num_computed_tokens` catches up with
its `num_tokens`; a decode is (nearly) a chunk of one token, see `is_decode`. Each step:
  1. running sequences, oldest admission first, each get min(uncomputed, budget left) tokens; when
     the pool cannot hold a chunk, the NEWEST running sequence is preempted (blocks freed, to be
     recomputed later) until it can — possibly the sequence itself;
  2. then waiting sequences in order, while budget and seats remain and nothing was preempted in
     this step: reuse their longest cached prefix, and admit one only when the pool has room for
     its whole remaining prompt.
The scheduler touches no tensors and no hashes; memory goes through the BlockManager. Its output
is an immutable ScheduledBatch, and it is the only writer of `num_computed_tokens`.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.device_defaults import require_int
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class ScheduledChunk(NamedTuple):
    """One sequence's chunk in one step, fixed when it is scheduled (a row of vLLM v1's SchedulerOutput).

    It runs `token_ids` at positions start, start + 1, ... over `block_table`. Why a snapshot: the
    engine advances computed counts and appends sampled tokens while the step is being handled,
    so whatever decides what a row is (decode, needs a sample, where it starts) must not read the
    live sequence. `seq` is the engine's handle for advancing and sampling, never read to decide.
    Why a NamedTuple: immutable, and about 4x cheaper to build than a frozen dataclass (one per
    running sequence per step).
    """

    seq: Sequence
    start: int  # the sequence's computed tokens when scheduled: the chunk's first position
    token_ids: tuple[int, ...]  # seq.token_ids[start : start + num_tokens]
    block_table: tuple[int, ...]  # the sequence's KV blocks, covering start + num_tokens tokens
    needs_sample: bool  # the chunk ends at the sequence's last token: its logits give the next one
    is_decode: bool  # see `is_decode`: the one definition of a decode for stats, runner and sampler
    # prompt_logprobs: logits wanted at the chunk's first `prompt_logits` positions (each predicts
    # the next prompt token); 0 for every other chunk
    prompt_logits: int = 0

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def max_total_tokens(self) -> int:
        """The most tokens the sequence may ever hold (its prompt and max_tokens never change)."""
        return self.seq.max_total_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def is_decode(num_tokens: int, start: int, num_prompt_tokens: int, needs_sample: bool) -> bool:
    """A decode: a one-token chunk that runs a sequence's newest token, a generated one.

    So a one-token prompt, the last token of a chunked prompt and a one-token piece of a
    recomputation after preemption are prefill chunks, not decodes.
    """
    return num_tokens == 1 and needs_sample and start >= num_prompt_tokens


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, immutable: the chunks in batch order and the sequences preempted for it."""

    chunks: tuple[ScheduledChunk, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()  # (source, destination) KV blocks to copy first (copy on write)

    @property
    def seqs(self) -> list[Sequence]:
        return [c.seq for c in self.chunks]

    @property
    def num_new_tokens(self) -> list[int]:
        return [c.num_tokens for c in self.chunks]

    @property
    def total_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def sampled(self) -> list[Sequence]:
        """The sequences that get a token from this step, in batch order (the logits' rows)."""
        return [c.seq for c in self.chunks if c.needs_sample]


class Scheduler:
    """Decides each step's chunks under `max_num_batched_tokens` and `max_num_seqs`."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be an integer >= 1, got {max_model_len!r}")
        if block_manager.block_size != config.block_size:
            raise ValueError(
                f"BlockManager block_size {block_manager.block_size} != EngineConfig.block_size {config.block_size}"
            )
        self.config = config
        self.max_num_seqs = require_int(config.max_num_seqs, "max_num_seqs")
        self.max_num_batched_tokens = require_int(config.max_num_batched_tokens, "max_num_batched_tokens")
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last (first to be preempted)
        self.num_preemptions = 0

    # ------------------------------------------------------------ requests

    def check_fits(self, seq: Sequence) -> str | None:
        """Why `seq` can NEVER be served, or None when it can."""
        if seq.num_prompt_tokens == 0:
            return f"request {seq.seq_id}: the prompt is empty (0 tokens)"
        if seq.max_total_tokens > self.max_model_len:
            return (
                f"request {seq.seq_id}: prompt ({seq.num_prompt_tokens} tokens) + max_tokens "
                f"({seq.params.max_tokens}) = {seq.max_total_tokens} exceeds max_model_len {self.max_model_len}"
            )
        # why: conservative by one token (the last sampled token never needs K/V), so a sequence
        # that passes can always run alone, which is what guarantees progress.
        needed = self.block_manager.blocks_needed(seq.max_total_tokens)
        if needed > self.block_manager.num_blocks:
            return (
                f"request {seq.seq_id}: prompt + max_tokens = {seq.max_total_tokens} tokens needs {needed} KV "
                f"blocks of {self.block_manager.block_size} tokens, but the whole pool has "
                f"{self.block_manager.num_blocks}; lower max_tokens or give the KV cache more memory"
            )
        return None

    def add(self, seq: Sequence) -> None:
        """Queue a request; ValueError (with `check_fits`'s message) if it can never be served."""
        message = self.check_fits(seq)
        if message is not None:
            raise ValueError(message)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---------------------------------------------------------------- step

    def schedule(self) -> ScheduledBatch:
        """This step's chunks, as a snapshot. The caller runs them, then calls `advance(batch)`."""
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        budget = self._schedule_running(chunks, preempted, self.max_num_batched_tokens)
        if not preempted:
            # why: after a preemption the pool is under pressure; admitting now would thrash.
            self._schedule_waiting(chunks, budget)
        copies = self.block_manager.take_copies()
        return ScheduledBatch(tuple(chunks), tuple(preempted), tuple(copies))

    def advance(self, batch: ScheduledBatch) -> None:
        """After the forward pass: the scheduled chunks' K/V are now in the cache.

        The scheduler is the only writer of `num_computed_tokens` (here, at admission, at preemption).
        """
        for chunk in batch.chunks:
            seq = chunk.seq
            if seq.num_computed_tokens != chunk.start:
                raise RuntimeError(
                    f"seq {seq.seq_id}: {seq.num_computed_tokens} computed tokens but its chunk starts at "
                    f"{chunk.start}; advance() called twice for one batch, or for a stale one?"
                )
            seq.num_computed_tokens = chunk.start + chunk.num_tokens

    def finish(self, seq: Sequence) -> None:
        """Mark finished (or aborted), drop it from the queues and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` (a new sample of `parent`'s prompt) from now on, sharing parent's KV blocks.

        `parent` has just computed its whole prompt; `child` holds the same tokens.
        """
        if child.token_ids != parent.token_ids or parent.num_computed_tokens != parent.num_tokens:
            raise ValueError(f"seq {child.seq_id} cannot fork from seq {parent.seq_id}: not at the same point")
        self.block_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    # ------------------------------------------------------------- helpers

    def _schedule_running(self, chunks: list[ScheduledChunk], preempted: list[Sequence], budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if n == 0:
                i += 1  # nothing to compute (the engine has not appended a token yet)
                continue
            if not self._allocate_or_preempt(seq, n, preempted):
                break  # seq preempted itself; it was the newest, so nothing follows it
            chunks.append(_snapshot(seq, n))
            budget -= n
            i += 1
        return budget

    def _allocate_or_preempt(self, seq: Sequence, n: int, preempted: list[Sequence]) -> bool:
        """Allocate `n` slots for a running seq, preempting newest-first; False if seq itself went."""
        while not self.block_manager.allocate_slots(seq, n):
            # why: victims come from the end, behind seq (index >= seq's), so none of them has
            # been scheduled in this batch yet.
            victim = self.running.pop()
            self._preempt(victim, preempted)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, preempted: list[Sequence]) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # why: to the front, so it is re-admitted before newer requests (FCFS, bounded delay)
        self.waiting.appendleft(seq)
        preempted.append(seq)
        logger.debug("preempted seq %d (%d tokens) to free KV blocks", seq.seq_id, seq.num_tokens)

    def _schedule_waiting(self, chunks: list[ScheduledChunk], budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.running and len(self.running) + seq.seats > self.max_num_seqs:
                break  # why: its samples will fork into seats of their own
            # why no cache for prompt logprobs: cached positions have no logits to take them from
            wants_logits = seq.params.prompt_logprobs is not None
            computed, num_cached = ([], 0) if wants_logits else bm.get_computed_blocks(seq)
            remaining = seq.num_tokens - num_cached
            # Admit only if the whole remaining prompt fits now, not just this chunk: a sequence
            # that can only start would soon be preempted and recomputed.
            if not bm.can_allocate(seq, remaining, computed):
                break  # keep FCFS order: nobody overtakes the head
            n = min(remaining, budget)
            if not bm.allocate_slots(seq, n, computed):
                raise RuntimeError(f"seq {seq.seq_id}: allocation failed after can_allocate said it fits")
            self.waiting.popleft()
            seq.num_computed_tokens = num_cached  # the matched blocks hold these tokens' K/V
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached  # the bill counts the first admission only
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(_snapshot(seq, n))
            budget -= n


def _snapshot(seq: Sequence, n: int) -> ScheduledChunk:
    """The next `n` tokens of `seq` as a frozen chunk (its blocks must already be allocated)."""
    start = seq.num_computed_tokens
    needs_sample = start + n == seq.num_tokens
    prompt_logits = 0
    if seq.params.prompt_logprobs is not None:
        prompt_logits = max(0, min(start + n, seq.num_prompt_tokens - 1) - start)
    return ScheduledChunk(
        seq=seq,
        start=start,
        token_ids=tuple(seq.token_ids[start : start + n]),
        block_table=tuple(seq.block_table),
        needs_sample=needs_sample,
        is_decode=is_decode(n, start, seq.num_prompt_tokens, needs_sample),
        prompt_logits=prompt_logits,
    )
