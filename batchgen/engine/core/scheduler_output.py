"""What the scheduler hands the rest of the engine each step: chunks, draws and a diff, as data only.

vLLM v1's SchedulerOutput: the whole contract between the scheduler and the runner side. No live
Sequence: chunks are snapshots by id, a BatchUpdate says what changed (new sequences with their
request's extras), the draws say who takes a token from which logits row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras


class ScheduledChunk(NamedTuple):
    """One sequence's chunk in one step, fixed when it is scheduled (a row of vLLM v1's SchedulerOutput).

    It runs `token_ids` at positions start, start + 1, ... over `block_table`. Why a snapshot: the
    scheduler advances computed counts and appends sampled tokens while the step is being handled,
    so whatever decides what a row is (decode, needs a sample, where it starts) must not read the
    live sequence, and the runner never sees one. Why a NamedTuple: immutable, and about 4x
    cheaper to build than a frozen dataclass (one per running sequence per step).
    """

    seq_id: int
    start: int  # the sequence's computed tokens when scheduled: the chunk's first position
    token_ids: tuple[int, ...]  # the sequence's tokens[start : start + num_tokens]
    block_table: tuple[int, ...]  # the sequence's KV blocks, covering start + num_tokens tokens
    needs_sample: bool  # the chunk ends at the sequence's last token: its logits give the next one
    # the one definition of a decode for stats, runner and sampler: a one-token chunk that runs the
    # sequence's newest token, a generated one (so a one-token prompt, a chunked prompt's last token
    # and a one-token piece of a recomputation after preemption are prefill chunks)
    is_decode: bool
    # prompt_logprobs: logits wanted at the chunk's first `prompt_logits` positions (each predicts
    # the next prompt token); 0 for every other chunk
    prompt_logits: int = 0
    max_len: int = 0  # the most tokens the sequence may ever hold (prompt + max_tokens); 0: unknown
    lora_slot: int = -1  # the device slot of the sequence's adapter (engine/lora); -1: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class NewSequence(NamedTuple):
    """A sequence the runner side has not seen: what its persistent state is built from.

    Why no block table: every chunk carries its own, and a sequence's first chunk comes in the same
    step (a forked sample's blocks are its parent's until its own first chunk).
    """

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    extras: RequestExtras = NO_EXTRAS  # what else the runner keeps for it (see RequestExtras)


@dataclass(frozen=True)
class BatchUpdate:
    """What changed for the runner side since the last update (vLLM v1's new/finished/resumed lists).

    new: first admitted (or forked) since; finished: ended or aborted since (some may never have
    been admitted: the runner ignores ids it does not know); preempted: lost their KV blocks, to be
    recomputed (their sampling state stays valid: their tokens are kept); resumed: preempted ones
    admitted again.
    """

    new: tuple[NewSequence, ...] = ()
    finished: tuple[int, ...] = ()
    preempted: tuple[int, ...] = ()
    resumed: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.new or self.finished or self.preempted or self.resumed)

    @property
    def released(self) -> tuple[int, ...]:
        """Sequences whose KV state must be dropped on the runner side: finished or preempted."""
        return self.finished + self.preempted


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work, immutable: the chunks in batch order, the copies to make first, the diff,
    and who draws a token from which of the sampled chunks' logits rows.

    `draws` are the sequences that take a token in this step; `draw_rows[i]` is the logits row
    (an index into `sampled`) draw i samples from, None when draw i takes row i (no fork, no
    end). A request with n > 1 whose prompt ends in this step forks there: its samples (in
    `forks`, new in `update`) share its blocks and its row. `ends` were scored, not sampled
    (max_tokens 0): their requests end after the step.
    """

    chunks: tuple[ScheduledChunk, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()  # (source, destination) KV blocks to copy first (copy on write)
    update: BatchUpdate = BatchUpdate()
    draws: tuple[int, ...] = ()
    draw_rows: tuple[int, ...] | None = None
    ends: tuple[int, ...] = ()
    forks: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (parent, its samples forked in this step)
    lora_loads: tuple[tuple[int, bytes], ...] = ()  # (slot, adapter content hash) to load before the forward

    @property
    def seq_ids(self) -> list[int]:
        return [c.seq_id for c in self.chunks]
