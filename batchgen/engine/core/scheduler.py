"""Scheduler: token-budget continuous batching with chunked prefill and preemption.

One rule for prefill and decode (vLLM v1): each sequence's `num_computed_tokens` catches up with
its `num_tokens`; a decode is (nearly) a chunk of one token, see ScheduledChunk.is_decode. Each step:
  1. running sequences, oldest admission first, each get min(uncomputed, budget left) tokens; when
     the pool cannot hold a chunk, the NEWEST running sequence is preempted (blocks freed, to be
     recomputed later) until it can — possibly the sequence itself;
  2. then waiting sequences in order, while budget and seats remain and nothing was preempted in
     this step: reuse their longest cached prefix, and admit one only when the pool has room for
     its whole remaining prompt.
The scheduler touches no tensors and no hashes; memory goes through the BlockManager.

It owns every sequence (vLLM v1's split): it is the only writer of a sequence's progress and
status, computed tokens (advanced when scheduled: a failed step aborts every sequence), output
tokens (`update_from_output`), status (`finish`, preemption, admission), and, through the block
manager, its blocks. A request with n > 1 forks in the step whose chunk ends its prompt: the
prompt is prefilled once, samples 1..n-1 share its blocks (copy on write) and its logits row. Its
output is an immutable ScheduledBatch (scheduler_output) that names sequences by id and carries
what changed since the last step (new, finished, preempted, resumed) as a BatchUpdate, from
which the runner side keeps its own state, and who draws from which row. `drop_all` forgets
every sequence at once (an aborted generate). With LoRA, an admitted sequence pins its adapter's
device slot (core/adapter_slots): a waiting one whose adapter finds no slot waits, in order, and
each chunk names its slot; the step carries the adapter loads to make before its forward.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence as Sequence_

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.core.adapter_slots import SlotTable
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.image_budget import ImageBudget, StepImages
from batchgen.engine.core.scheduler_output import BatchUpdate, NewSequence, ScheduledBatch, ScheduledChunk
from batchgen.engine.core.sequence import Sequence, SequenceStatus, fork_params

logger = logging.getLogger(__name__)

Forks = tuple[tuple[int, tuple[int, ...]], ...]


class Scheduler:
    """Decides each step's chunks under `max_num_batched_tokens` and `max_num_seqs`."""

    def __init__(self, config: ResolvedConfig, block_manager: BlockManager, max_model_len: int) -> None:
        if block_manager.block_size != config.block_size:
            raise ValueError(
                f"BlockManager block_size {block_manager.block_size} != the config's block_size {config.block_size}"
            )
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last (first to be preempted)
        self._seqs: dict[int, Sequence] = {}  # every unfinished sequence, waiting or running
        self._special: dict[int, Sequence] = {}  # prompts whose end forks (n > 1) or ends (max_tokens 0)
        self._next_id = 0  # above every sequence id seen: forked samples take theirs from here
        self.num_preemptions = 0
        # the diff since the last update was taken (schedule() or take_update())
        self._new: list[NewSequence] = []
        self._finished: list[int] = []
        self._preempted: list[int] = []
        self._resumed: list[int] = []
        # adapters' device slots (engine/lora): admitted sequences pin theirs; loads ride in the step
        self.slots = SlotTable(config.max_loras or 1) if config.enable_lora else None
        self._loads: list[tuple[int, bytes]] = []
        # what a step's chunks may touch of images (encoder cache tokens, decoded pixels)
        self.images = ImageBudget(config.encoder_cache_tokens, config.max_num_batched_tokens, config.max_decoded_pixels)

    # ------------------------------------------------------------ requests

    def check_fits(self, seq: Sequence) -> str | None:
        """Why `seq` can NEVER be served, or None when it can."""
        if seq.num_prompt_tokens == 0:
            return f"request {seq.seq_id}: the prompt is empty (0 tokens)"
        if seq.extras.adapter_hash and self.slots is None:
            return f"request {seq.seq_id}: a LoRA adapter needs an engine with enable_lora"
        if seq.extras.image_positions and (why := self.images.check_image(seq)) is not None:
            return why
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
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq {seq.seq_id} is already queued")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._seqs[seq.seq_id] = seq
        self._next_id = max(self._next_id, seq.seq_id + 1)
        if seq.params.n > 1 or seq.params.max_tokens == 0:
            self._special[seq.seq_id] = seq

    def new_seq_id(self) -> int:
        """An id no sequence of this scheduler has had (a request's; its forked samples take more)."""
        self._next_id += 1
        return self._next_id - 1

    def get(self, seq_id: int) -> Sequence:
        """The unfinished sequence `seq_id` (KeyError when there is none): read it, never write it."""
        return self._seqs[seq_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- step

    def schedule(self) -> ScheduledBatch:
        """This step's chunks, as a snapshot, with the diff since the last update and the step's
        draws; the chunks' sequences are advanced now (their K/V is in the cache once the step has
        run). The caller runs the batch, then hands the drawn tokens to `update_from_output`."""
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        images = self.images.step()
        budget = self._schedule_running(chunks, preempted, self.config.max_num_batched_tokens, images)
        if not preempted:
            # why: after a preemption the pool is under pressure; admitting now would thrash.
            self._schedule_waiting(chunks, budget, images)
        seqs = self._seqs
        for chunk in chunks:  # the only writer of computed counts, once per scheduled chunk
            seqs[chunk.seq_id].num_computed_tokens = chunk.start + chunk.num_tokens
        sampled = tuple(c.seq_id for c in chunks if c.needs_sample)
        copies = tuple(self.block_manager.take_copies())
        loads, self._loads = tuple(self._loads), []
        if self._special and any(s in self._special for s in sampled):
            draws, rows, ends, forks = self._expand(sampled)
            return ScheduledBatch(tuple(chunks), copies, self.take_update(), draws, rows, ends, forks, loads)
        return ScheduledBatch(tuple(chunks), copies, self.take_update(), sampled, lora_loads=loads)

    def take_update(self) -> BatchUpdate:
        """The diff since the last one was taken, and a fresh one begins. schedule() takes it for its
        batch; the engine takes it after a run's last step (the last finished sequences have no
        next step to tell the runner)."""
        update = BatchUpdate(tuple(self._new), tuple(self._finished), tuple(self._preempted), tuple(self._resumed))
        if update:
            self._new, self._finished, self._preempted, self._resumed = [], [], [], []
        return update

    def _expand(self, sampled: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], Forks]:
        """The draws when a special prompt ends in this step: a parent forks (its row serves all n
        samples, parent first); a max_tokens 0 request ends unsampled. -> (draws, their rows, ends, forks)."""
        draws: list[int] = []
        rows: list[int] = []
        ends: list[int] = []
        forks: list[tuple[int, tuple[int, ...]]] = []
        for i, seq_id in enumerate(sampled):
            seq = self._special.pop(seq_id, None)
            if seq is None:
                draws.append(seq_id)
                rows.append(i)
            elif seq.params.max_tokens == 0:
                ends.append(seq_id)
            else:
                children = tuple(self._fork(seq, index) for index in range(1, seq.params.n))
                forks.append((seq_id, children))
                draws.extend((seq_id, *children))
                rows.extend([i] * (1 + len(children)))
        return tuple(draws), tuple(rows), tuple(ends), tuple(forks)

    def update_from_output(self, seq_ids: Sequence_[int], tokens: Sequence_[int]) -> None:
        """The step's sampled tokens: `tokens[i]` is appended to sequence `seq_ids[i]` (the sampled
        chunks' sequences in batch order, and any samples forked from them)."""
        seqs = self._seqs
        for seq_id, token in zip(seq_ids, tokens, strict=True):
            seqs[seq_id].token_ids.append(token)

    def finish(self, seq_id: int) -> None:
        """Mark finished (or aborted), drop it from the queues and release its blocks; the runner
        hears of it in the next update."""
        seq = self._seqs.pop(seq_id)
        self._special.pop(seq_id, None)
        admitted = seq.status is SequenceStatus.RUNNING or seq.num_preemptions > 0
        if self.slots is not None and seq.extras.adapter_hash and admitted:
            self.slots.unpin(seq.extras.adapter_hash)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq_id)
        self._finished.append(seq_id)

    def drop_all(self) -> int:
        """Forget every sequence and the whole pool state (an aborted generate); returns how many.

        No update follows: the runner side drops its state alike (ModelRunner.drop_all).
        """
        dropped = len(self._seqs)
        for seq in self._seqs.values():
            seq.status = SequenceStatus.FINISHED
        self.waiting.clear()
        self.running.clear()
        self._seqs.clear()
        self._special.clear()
        self._new, self._finished, self._preempted, self._resumed = [], [], [], []
        self.block_manager.reset()
        if self.slots is not None:
            self.slots.reset()
        self._loads = []
        return dropped

    # ------------------------------------------------------------- helpers

    def _schedule_running(
        self, chunks: list[ScheduledChunk], preempted: list[Sequence], budget: int, images: StepImages
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = images.cut(seq, seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget))
            if n == 0:
                i += 1  # nothing to compute (the engine has not appended a token yet)
                continue
            if not self._allocate_or_preempt(seq, n, preempted):
                break  # seq preempted itself; it was the newest, so nothing follows it
            chunks.append(self._snapshot(seq, n))
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
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # why: to the front, so it is re-admitted before newer requests (FCFS, bounded delay)
        self.waiting.appendleft(seq)
        preempted.append(seq)
        self._preempted.append(seq.seq_id)
        logger.debug("preempted seq %d (%d tokens) to free KV blocks", seq.seq_id, seq.num_tokens)

    def _schedule_waiting(self, chunks: list[ScheduledChunk], budget: int, images: StepImages) -> None:
        max_seqs, bm = self.config.max_num_seqs, self.block_manager
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            seq = self.waiting[0]
            if self.running and len(self.running) + seq.seats > max_seqs:
                break  # why: its samples will fork into seats of their own
            adapter = seq.extras.adapter_hash if seq.num_preemptions == 0 else b""  # a preempted one kept its pin
            if adapter and self.slots is not None and not self.slots.can_pin(adapter):
                break  # why: every slot is pinned by admitted sequences; keep FCFS order
            # the longest cached prefix; why none for prompt logprobs (or mean / CLS pooling): cached
            # positions have no outputs
            use_cache = seq.params.prompt_logprobs is None and not seq.extras.uncached
            computed, cached = bm.get_computed_blocks(seq) if use_cache else ([], 0)
            remaining = seq.num_tokens - cached
            # why the whole remaining prompt, not just this chunk: a sequence that can only start
            # would soon be preempted and recomputed
            if not bm.can_allocate(seq, remaining, computed):
                break  # keep FCFS order: nobody overtakes the head
            n = images.cut(seq, cached, min(remaining, budget))
            if n == 0:
                break
            if not bm.allocate_slots(seq, n, computed):
                raise RuntimeError(f"seq {seq.seq_id}: allocation failed after can_allocate said it fits")
            seq.num_computed_tokens = cached  # the matched blocks hold these tokens' K/V
            self.waiting.popleft()
            if adapter:
                self._pin(adapter)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens  # the bill counts the first admission only
                self._new.append(NewSequence(seq.seq_id, tuple(seq.prompt_token_ids), seq.params, seq.extras))
            else:
                self._resumed.append(seq.seq_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(self._snapshot(seq, n))
            budget -= n

    def _pin(self, adapter: bytes) -> None:
        """One more admitted sequence of `adapter`; its load rides in this step when it was not resident."""
        assert self.slots is not None  # check_fits refuses adapters without slots
        slot, load = self.slots.pin(adapter)
        if load:
            self._loads.append((slot, adapter))

    def _fork(self, parent: Sequence, index: int) -> int:
        """Sample `index` of `parent`'s just-computed prompt, running from now on and sharing its
        KV blocks; announced as new in this step's update (it draws in this step). -> its id."""
        child = Sequence(self.new_seq_id(), list(parent.prompt_token_ids), fork_params(parent.params, index))
        child.extras = parent.extras
        if child.extras.adapter_hash:
            self._pin(child.extras.adapter_hash)  # resident: the parent pins it
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self._seqs[child.seq_id] = child
        self._new.append(NewSequence(child.seq_id, tuple(child.prompt_token_ids), child.params, child.extras))
        return child.seq_id

    def _snapshot(self, seq: Sequence, n: int) -> ScheduledChunk:
        """The next `n` tokens of `seq` as a frozen chunk (its blocks must already be allocated)."""
        start = seq.num_computed_tokens
        needs_sample = start + n == seq.num_tokens
        prompt_logits = 0
        if seq.params.prompt_logprobs is not None:
            prompt_logits = max(0, min(start + n, seq.num_prompt_tokens - 1) - start)
        adapter = seq.extras.adapter_hash
        return ScheduledChunk(
            seq.seq_id,
            start,
            tuple(seq.token_ids[start : start + n]),
            tuple(self.block_manager.block_table(seq.seq_id)),
            needs_sample,
            n == 1 and needs_sample and start >= seq.num_prompt_tokens,  # is_decode
            prompt_logits,
            seq.max_total_tokens,
            self.slots.slot_of(adapter) if adapter and self.slots is not None else -1,
        )
