"""Scheduler: budgets every step, chunked prefill, admission, preemption, no hang, prefix reuse."""

from __future__ import annotations

import random

import pytest

from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.scheduler_output import ScheduledBatch
from batchgen.engine.core.sequence import Sequence, SequenceStatus


def make_scheduler(
    num_blocks: int,
    block_size: int = 4,
    budget: int = 64,
    max_seqs: int = 8,
    caching: bool = True,
    max_model_len: int = 4096,
) -> Scheduler:
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=caching,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, caching), max_model_len)


def sizes(batch: ScheduledBatch) -> list[int]:
    return [c.num_tokens for c in batch.chunks]


def sampled(batch: ScheduledBatch) -> list[int]:
    return [c.seq_id for c in batch.chunks if c.needs_sample]


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def check_invariants(sched: Scheduler, batch: ScheduledBatch) -> None:
    cfg, bm = sched.config, sched.block_manager
    assert sum(sizes(batch)) <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    assert len(set(batch.seq_ids)) == len(batch.seq_ids)
    for chunk in batch.chunks:
        seq, n = sched.get(chunk.seq_id), chunk.num_tokens
        assert n >= 1 and seq.status is SequenceStatus.RUNNING
        assert seq.num_computed_tokens == chunk.start + n <= seq.num_tokens  # advanced by schedule()
        assert len(bm.block_table(seq.seq_id)) == bm.blocks_needed(chunk.start + n)
        assert chunk.block_table == tuple(bm.block_table(seq.seq_id))  # a copy, as data
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        for block_id in bm.block_table(seq.seq_id):
            refs[block_id] += 1
    assert refs == bm.ref_counts
    assert bm.num_free_blocks == refs.count(0)
    for seq in sched.waiting:
        assert bm.block_table(seq.seq_id) == [] and seq.num_computed_tokens == 0


def step(sched: Scheduler, finished: list[Sequence] | None = None) -> ScheduledBatch:
    """A fake engine step: schedule (which advances), 'forward', sample a token, finish at max_tokens."""
    batch = sched.schedule()
    check_invariants(sched, batch)
    drawn = sampled(batch)
    sched.update_from_output(drawn, [1000 + seq_id for seq_id in drawn])
    for seq_id in drawn:
        seq = sched.get(seq_id)
        if seq.num_output_tokens == seq.params.max_tokens:
            sched.finish(seq_id)
            if finished is not None:
                finished.append(seq)
    return batch


def ids(*seqs: Sequence) -> list[int]:
    return [s.seq_id for s in seqs]


def table(sched: Scheduler, seq: Sequence) -> list[int]:
    return sched.block_manager.block_table(seq.seq_id)


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        step(sched, finished)
    raise AssertionError(
        f"not finished after {max_steps} steps: {len(sched.running)} running, {len(sched.waiting)} waiting"
    )


# ----------------------------------------------------------------- admission checks


def test_check_fits_messages_and_add_raises() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=20)
    assert sched.check_fits(make_seq(0, [1] * 10, max_tokens=6)) is None  # 16 tokens = whole pool
    assert "empty" in sched.check_fits(make_seq(1, []))
    too_long = sched.check_fits(make_seq(2, [1] * 15, max_tokens=6))
    assert "21 exceeds max_model_len 20" in too_long
    sched.max_model_len = 100
    too_big = sched.check_fits(make_seq(3, [1] * 15, max_tokens=6))
    assert "needs 6 KV blocks" in too_big and "whole pool has 4" in too_big
    with pytest.raises(ValueError, match="whole pool has 4"):
        sched.add(make_seq(3, [1] * 15, max_tokens=6))
    assert not sched.has_unfinished()


def test_block_size_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(EngineConfig(block_size=16), BlockManager(8, 4), 128)


# ----------------------------------------------------------------- chunked prefill


def test_chunked_prefill_chunk_sizes_then_decodes() -> None:
    sched = make_scheduler(num_blocks=32, budget=16)
    seq = make_seq(0, list(range(40)), max_tokens=3)
    sched.add(seq)
    chunks = [sizes(step(sched)) for _ in range(5)]
    assert chunks == [[16], [16], [8], [1], [1]]
    assert seq.status is SequenceStatus.FINISHED and seq.output_token_ids == [1000] * 3
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == 32


def test_running_first_then_waiting_share_the_budget() -> None:
    sched = make_scheduler(num_blocks=32, budget=16)
    a, b = make_seq(0, list(range(10))), make_seq(1, list(range(50, 60)))
    sched.add(a)
    sched.add(b)
    first = step(sched)
    assert first.seq_ids == ids(a, b) and sizes(first) == [10, 6]
    second = step(sched)
    assert second.seq_ids == ids(a, b) and sizes(second) == [1, 4]
    third = step(sched)
    assert sizes(third) == [1, 1]


def test_max_num_seqs_limits_admission() -> None:
    sched = make_scheduler(num_blocks=64, budget=256, max_seqs=2)
    seqs = [make_seq(i, [i] * 5) for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    batch = step(sched)
    assert batch.seq_ids == ids(*seqs[:2]) and len(sched.waiting) == 3


# ----------------------------------------------------------------- memory pressure


def test_admission_blocked_while_pool_is_full_and_order_kept() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    a = make_seq(0, [1] * 16, max_tokens=4)  # 4 blocks of 6
    b = make_seq(1, [2] * 12, max_tokens=4)  # needs 3 blocks for its prompt: does not fit beside a
    c = make_seq(2, [3] * 2, max_tokens=4)  # would fit, but must not overtake b
    for seq in (a, b, c):
        sched.add(seq)
    batch = step(sched)
    assert batch.seq_ids == ids(a) and list(sched.waiting) == [b, c]
    step(sched)
    assert list(sched.waiting) == [b, c]
    finished = run_to_completion(sched)
    assert finished[0] is a and {s.seq_id for s in finished} == {0, 1, 2}


def test_preemption_picks_the_newest_which_is_recomputed_to_completion() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, caching=False)
    a, b, c = make_seq(0, [1] * 4), make_seq(1, [2] * 6), make_seq(2, [3] * 6)
    for seq in (a, b, c):
        sched.add(seq)
    step(sched)
    assert [table(sched, s) for s in (a, b, c)] == [[0], [1, 2], [3, 4]]  # pool exhausted
    d = make_seq(3, [4])
    sched.add(d)
    batch = step(sched)  # a (the oldest) needs a 2nd block: c, the newest, makes room
    assert batch.update.preempted == (c.seq_id,) and batch.seq_ids == ids(a, b) and table(sched, a) == [0, 3]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and table(sched, c) == []
    # c goes back in FRONT of the newer request d, and nobody is admitted in a preempting step
    assert c.num_preemptions == 1 and sched.num_preemptions == 1 and list(sched.waiting) == [c, d]
    assert c.num_tokens == 7  # its generated token is kept and recomputed, not regenerated
    finished = run_to_completion(sched)
    assert (
        finished.index(c) < finished.index(d) and c.num_output_tokens == 4 and c.num_computed_tokens == c.num_tokens - 1
    )
    assert c.output_token_ids == [1002] * 4


def test_a_sequence_preempts_itself_when_it_is_the_newest() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4, budget=64, caching=False)
    a, b = make_seq(0, [1] * 4, 5), make_seq(1, [2] * 4, 5)
    sched.add(a)
    sched.add(b)
    step(sched)  # a: block 0, b: block 1 (one free)
    batch = step(sched)  # a takes the last block; b then cannot and is itself the newest
    assert batch.seq_ids == ids(a) and batch.update.preempted == (b.seq_id,)
    assert run_to_completion(sched)[-1] is b


def test_no_hang_with_a_tiny_pool() -> None:
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=5, block_size=4, budget=9, max_seqs=4, caching=True)
    seqs = [
        make_seq(i, [rng.randrange(3) for _ in range(rng.randint(1, 12))], rng.randint(1, 20 - 12)) for i in range(30)
    ]
    for seq in seqs:
        sched.add(seq)
    finished = run_to_completion(sched, max_steps=5_000)
    assert len(finished) == 30 and all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.num_preemptions > 0  # the pool really was too small for all of them
    assert sched.block_manager.num_free_blocks == 5


@pytest.mark.parametrize("seed", range(4))
def test_randomized_run_keeps_budget_seats_and_ref_counts(seed: int) -> None:
    rng = random.Random(seed)
    sched = make_scheduler(
        num_blocks=rng.randint(12, 40),
        block_size=rng.choice([1, 2, 4, 8]),
        budget=rng.randint(8, 64),
        max_seqs=rng.randint(1, 8),
    )
    shared = [rng.randrange(50) for _ in range(rng.randint(0, 20))]
    seqs = []
    for i in range(40):
        prompt = shared[: rng.randint(0, len(shared))] + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        seq = make_seq(i, prompt, rng.randint(1, 12))
        if sched.check_fits(seq) is None:
            sched.add(seq)
            seqs.append(seq)
        if rng.random() < 0.3:
            step(sched)  # requests keep arriving while the engine runs
    run_to_completion(sched)
    assert all(s.status is SequenceStatus.FINISHED and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


# ----------------------------------------------------------------- prefix cache


def test_prefix_hits_counted_in_num_cached_tokens_from_first_admission() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    a = make_seq(0, list(range(10)), max_tokens=2)
    sched.add(a)
    step(sched)
    b = make_seq(1, list(range(9)) + [77, 78], max_tokens=2)  # shares 2 full blocks with a
    sched.add(b)
    batch = step(sched)
    assert batch.seq_ids == ids(a, b) and sizes(batch) == [1, 3]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert b.num_computed_tokens == 8 + 3  # the scheduler set 8 at admission, schedule() added the chunk
    run_to_completion(sched)


def test_same_step_admission_reuses_blocks_registered_in_that_step() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    a, b = make_seq(0, list(range(9))), make_seq(1, list(range(8)) + [55])
    sched.add(a)
    sched.add(b)
    batch = step(sched)
    assert sizes(batch) == [9, 1] and b.num_cached_tokens == 8
    assert table(sched, b)[:2] == table(sched, a)[:2]


def test_readmission_reuses_own_cached_blocks_but_bills_the_first_count() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    a, c = make_seq(0, [1] * 4), make_seq(1, [3] * 9)
    sched.add(a)
    sched.add(c)
    step(sched)  # a: block 0; c: blocks 1, 2 (full, hashed) and 3
    assert step(sched).update.preempted == (c.seq_id,)  # a needs a block; c's hashed blocks stay cached
    while c.status is not SequenceStatus.RUNNING:
        batch = step(sched)
    assert batch.seq_ids[-1] == c.seq_id and sizes(batch)[-1] == 2  # 10 tokens, 8 of them cached
    assert c.num_cached_tokens == 0  # the re-match is not billed: its first admission matched nothing
    run_to_completion(sched)


def test_admission_needs_room_for_the_whole_prompt_not_just_the_chunk() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, budget=4, caching=False)
    a, b = make_seq(0, [1] * 12), make_seq(1, [2] * 16)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        step(sched)  # a prefills in chunks of 4: 3 blocks, 3 free
    batch = step(sched)  # 3 tokens of budget left, a 3-token chunk of b would fit, all 16 would not
    assert batch.seq_ids == ids(a) and list(sched.waiting) == [b]
    finished = run_to_completion(sched)
    assert finished == [a, b] and sched.num_preemptions == 0


def test_200_sequences_behind_a_shared_prefix_compute_it_about_once() -> None:
    prefix_len, results = 512, {}
    for on in (True, False):
        sched = make_scheduler(num_blocks=4000, block_size=16, budget=2048, max_seqs=64, caching=on)
        seqs = [make_seq(i, list(range(prefix_len)) + [1000 + i] * 7, max_tokens=4) for i in range(200)]
        for seq in seqs:
            sched.add(seq)
        prefix_computed = 0
        for _ in range(10_000):
            if not sched.has_unfinished():
                break
            batch = sched.schedule()
            for chunk in batch.chunks:
                prefix_computed += max(0, min(chunk.start + chunk.num_tokens, prefix_len) - chunk.start)
            sched.update_from_output(sampled(batch), [1] * len(sampled(batch)))
            for seq_id in sampled(batch):
                seq = sched.get(seq_id)
                if seq.num_output_tokens == seq.params.max_tokens:
                    sched.finish(seq_id)
        results[on] = (prefix_computed, sum(s.num_cached_tokens for s in seqs))
    assert results[False] == (200 * prefix_len, 0)
    assert results[True][0] <= 0.1 * results[False][0]
    assert results[True][1] == 199 * prefix_len


# ----------------------------------------------------------------- engine-facing contract


def test_finish_aborts_a_waiting_sequence_and_schedule_advances_what_it_scheduled() -> None:
    sched = make_scheduler(num_blocks=8, budget=4)
    a, b = make_seq(0, [1] * 6), make_seq(1, [2] * 3)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seq_ids == ids(a) and sizes(batch) == [4] and not batch.chunks[0].needs_sample
    sched.finish(b.seq_id)  # aborted before admission
    assert b.status is SequenceStatus.FINISHED and not sched.waiting
    assert a.num_computed_tokens == 4  # advanced when scheduled: the scheduler is its only writer
    assert sched.schedule().chunks[0].start == 4  # the next step goes on from there


# ----------------------------------------------------------------- the batch is a snapshot


def test_batch_is_a_frozen_snapshot_that_sampling_does_not_change() -> None:
    sched = make_scheduler(num_blocks=16, budget=8)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, list(range(10, 20)))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()  # a whole (3 tokens), b's first 5
    before = [(c.start, c.token_ids, c.block_table, c.needs_sample, c.is_decode) for c in batch.chunks]
    assert before == [
        (0, (1, 2, 3), tuple(table(sched, a)), True, False),
        (0, (10, 11, 12, 13, 14), tuple(table(sched, b)), False, False),
    ]
    sched.update_from_output([a.seq_id], [7])  # what the engine does with a's sample
    assert [(c.start, c.token_ids, c.block_table, c.needs_sample, c.is_decode) for c in batch.chunks] == before
    with pytest.raises(AttributeError):
        batch.chunks[0].needs_sample = False  # type: ignore[misc]
    nxt = sched.schedule()
    assert [(c.seq_id, c.start, c.token_ids, c.needs_sample, c.is_decode) for c in nxt.chunks] == [
        (a.seq_id, 3, (7,), True, True),
        (b.seq_id, 5, (15, 16, 17, 18, 19), True, False),
    ]


def test_what_counts_as_a_decode() -> None:
    """A decode runs a sequence's newest, generated token; other one-token chunks are prefill."""
    sched = make_scheduler(num_blocks=16, budget=4)
    one, chunked = make_seq(0, [5]), make_seq(1, list(range(20, 24)))
    sched.add(one)
    sched.add(chunked)
    first = sched.schedule()  # the one-token prompt, and 3 tokens of the chunked one
    assert [(c.num_tokens, c.needs_sample, c.is_decode) for c in first.chunks] == [(1, True, False), (3, False, False)]
    sched.update_from_output([one.seq_id], [6])
    second = sched.schedule()  # one's first decode; chunked's last prompt token
    assert [(c.num_tokens, c.needs_sample, c.is_decode) for c in second.chunks] == [(1, True, True), (1, True, False)]


def test_block_manager_leaves_computed_counts_to_the_scheduler() -> None:
    sched = make_scheduler(num_blocks=16, budget=64)
    a = make_seq(0, list(range(9)))
    sched.add(a)
    step(sched)
    b = make_seq(1, list(range(8)) + [55])
    computed, cached = sched.block_manager.get_computed_blocks(b)
    assert cached == 8 and sched.block_manager.allocate_slots(b, 1, computed)
    assert b.num_computed_tokens == 0  # allocation alone never moves it


# ----------------------------------------------------------------- n > 1: forks inside schedule()


def test_a_request_forks_in_the_step_its_prompt_ends_sharing_blocks_and_its_row() -> None:
    """schedule() hands over everything the step needs: the samples of an n > 1 request are made
    when its prompt's last chunk is scheduled (not before, and not by the caller), share its blocks
    and draw from its logits row; the parent alone keeps the prompt logprobs."""
    sched = make_scheduler(num_blocks=16, block_size=4, budget=5)
    other = make_seq(0, [9, 9], max_tokens=3)
    params = SamplingParams(max_tokens=3, n=3, seed=7, prompt_logprobs=1, temperature=0.8)
    parent = Sequence(1, list(range(1, 7)), params)  # 6 tokens: two chunks of 3 under a budget of 5
    sched.add(other)
    sched.add(parent)
    first = sched.schedule()  # other's 2 tokens, 3 of the parent's prompt: no fork yet
    assert first.draws == (0,) and first.draw_rows is None and not first.forks
    sched.update_from_output(first.draws, [5])
    second = sched.schedule()  # other decodes; the parent's last 3 prompt tokens: it forks now
    assert [c.seq_id for c in second.chunks] == [0, 1]
    ((forked_from, children),) = second.forks
    assert forked_from == 1 and len(children) == 2 and not {0, 1} & set(children)
    assert second.draws == (0, 1, *children) and second.draw_rows == (0, 1, 1, 1)
    assert [n.seq_id for n in second.update.new] == list(children)  # the runner hears of them in this step
    bm = sched.block_manager
    assert all(bm.block_table(c) == bm.block_table(1) for c in children)  # shared, not copied
    assert all(bm.ref_counts[b] == 3 for b in bm.block_table(1))
    kids = [sched.get(c) for c in children]
    assert [k.params.seed for k in kids] == [8, 9] and all(k.params.n == 1 for k in kids)
    assert all(k.params.prompt_logprobs is None for k in kids) and parent.params.prompt_logprobs == 1
    assert all(k.num_computed_tokens == parent.num_computed_tokens == 6 for k in kids)
    sched.update_from_output(second.draws, [5, 11, 12, 13])
    third = sched.schedule()  # every sample decodes its own token: the shared block is copied first
    assert sorted(c.seq_id for c in third.chunks) == sorted([0, 1, *children]) and not third.forks
    # the shared half-full block: the first two of its three writers copy it, the last owns it
    assert third.draw_rows is None and len(third.copies) == 2


def test_a_max_tokens_0_request_ends_after_its_prompt_without_a_draw() -> None:
    sched = make_scheduler(num_blocks=16, block_size=4, budget=64)
    scored = Sequence(0, [1, 2, 3], SamplingParams(max_tokens=0, n=2, prompt_logprobs=0))
    sched.add(scored)
    sched.add(make_seq(1, [4, 5]))
    batch = sched.schedule()
    assert sampled(batch) == [0, 1] and batch.ends == (0,) and batch.draws == (1,) and batch.draw_rows == (1,)
    assert not batch.forks and len(sched.running) == 2  # never forked: its n outputs are all empty
