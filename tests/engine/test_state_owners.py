"""One owner of sequence state: the scheduler's diffs, the runner's persistent batch, explicit releases.

The scheduler alone writes a sequence's progress and hands the runner side what changed (new,
finished, preempted, resumed ids) as data; the runner keeps its sampling batch and decode rows from
those diffs alone; abort_all drops every owner's whole state.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.scheduler_output import BatchUpdate, NewSequence, ScheduledBatch, ScheduledChunk
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.batch import NO_TOP_K, SamplingBatch
from batchgen.engine.sampling.penalties import LogitsFeatures
from batchgen.engine.staging.transfers import Transfers
from tests.engine.test_sampler import num_seeded
from tests.engine.test_scheduler import make_scheduler, make_seq

Diff = tuple[list[int], list[int], list[int], list[int]]


def _diff(update: BatchUpdate) -> Diff:
    return [n.seq_id for n in update.new], list(update.finished), list(update.preempted), list(update.resumed)


def _step(sched: Scheduler) -> ScheduledBatch:
    """An engine step without a model: schedule (which advances), one token per sampled chunk, finish at max_tokens."""
    batch = sched.schedule()
    sampled = [c.seq_id for c in batch.chunks if c.needs_sample]
    sched.update_from_output(sampled, [100 + s for s in sampled])
    for seq_id in sampled:
        seq = sched.get(seq_id)
        if seq.num_output_tokens == seq.params.max_tokens:
            sched.finish(seq_id)
    return batch


def test_each_steps_update_names_exactly_what_changed_since_the_last() -> None:
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64, caching=False)
    a, b, c = make_seq(0, [1] * 4, 2), make_seq(1, [2] * 6, 4), make_seq(2, [3] * 6, 4)
    for seq in (a, b, c):
        sched.add(seq)
    diffs = [_diff(_step(sched).update)]  # all three admitted: blocks [0], [1, 2], [3, 4]
    sched.add(make_seq(3, [4], 1))
    while sched.has_unfinished():
        diffs.append(_diff(_step(sched).update))
    assert diffs == [
        ([0, 1, 2], [], [], []),
        ([], [], [2], []),  # a needs a 2nd block: c, the newest, is preempted; nobody is admitted
        ([3], [0], [], [2]),  # a finished (2 tokens) last step: c comes back (resumed, not new), d is new
        ([], [3], [], []),  # d finished (1 token)
        ([], [1], [], []),  # b finished (4 tokens); c finishes in this step
    ]
    assert _diff(sched.take_update()) == ([], [2], [], [])  # the last finish waits for a taker
    assert _diff(sched.take_update()) == ([], [], [], [])  # and is handed over once


@pytest.mark.parametrize("seed", range(3))
def test_a_runner_that_follows_only_the_diffs_knows_exactly_the_admitted_sequences(seed: int) -> None:
    """Mirror what a runner keeps from the updates alone; it must match the scheduler after every step."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.randint(8, 20), block_size=4, budget=rng.randint(8, 40), max_seqs=6)
    known: set[int] = set()  # sequences with runner-side state: admitted once, not finished
    without_kv: set[int] = set()  # preempted and not resumed: their decode rows must be gone
    for i in range(30):
        seq = make_seq(i, [rng.randrange(30) for _ in range(rng.randint(1, 14))], rng.randint(1, 6))
        if sched.check_fits(seq) is None:
            sched.add(seq)
        for _ in range(rng.randint(0, 2)):
            if sched.has_unfinished():
                update = _step(sched).update
                assert not set(update.finished) & {n.seq_id for n in update.new}
                known = (known - set(update.finished)) | {n.seq_id for n in update.new}
                without_kv = (without_kv | set(update.preempted)) - set(update.resumed) - set(update.finished)
                admitted = {s.seq_id for s in sched.running} | {s.seq_id for s in sched.waiting if s.num_preemptions}
                # finished ids arrive one update late: the ones finished in this step are still known
                assert known - admitted <= {s for s in known if s not in sched._seqs}
                assert admitted <= known
                assert without_kv == {s.seq_id for s in sched.waiting if s.num_preemptions}


def test_no_chunk_or_update_carries_a_live_sequence() -> None:
    sched = make_scheduler(num_blocks=16, budget=8)
    for i in range(3):
        sched.add(make_seq(i, list(range(10 * i, 10 * i + 6)), 3))
    assert "seq" not in ScheduledChunk._fields
    seen: list[Any] = []

    def walk(value: Any) -> None:
        seen.append(value)
        assert not isinstance(value, Sequence), f"a live Sequence in the scheduler's output: {value}"
        if dataclasses.is_dataclass(value) and not isinstance(value, SamplingParams):
            for f in dataclasses.fields(value):
                walk(getattr(value, f.name))
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)

    while sched.has_unfinished():
        batch = _step(sched)
        walk(batch)
        for chunk in batch.chunks:
            assert all(type(t) is int for t in chunk.token_ids + chunk.block_table)
    assert any(isinstance(v, NewSequence) for v in seen)


def _new(seq_id: int, **params: Any) -> NewSequence:
    return NewSequence(seq_id, (1, 2, 3), SamplingParams(max_tokens=8, **params))


def test_the_sampling_batch_keeps_rows_from_adds_and_removes() -> None:
    batch = SamplingBatch(torch.device("cpu"), LogitsFeatures(None, 64, []), Transfers(torch.device("cpu")))
    batch.apply(BatchUpdate(new=(_new(10, temperature=0.0), _new(11, top_k=5, seed=3), _new(12, top_p=0.5))))
    assert batch._row_of == {10: 0, 11: 1, 12: 2} and num_seeded(batch) == 1
    first = batch.step([10, 11, 12])
    assert first.rows == [0, 1, 2] and first.sample_rows == [1, 2] and first.seeded == [0]
    assert first.params is not None and first.params.tolist() == [[1.0, 5.0, 1.0, 0.0], [1.0, NO_TOP_K, 0.5, 0.0]]
    assert first.max_k(64) == 5 and first.need_p and not first.need_min_p
    assert batch.step([10, 11, 12]) is first  # unchanged rows: the same view, nothing rebuilt
    batch.apply(BatchUpdate(finished=(11, 99)))  # 99: never known, ignored
    assert batch._row_of == {10: 0, 12: 2} and num_seeded(batch) == 0
    batch.apply(BatchUpdate(new=(_new(13, min_p=0.2, min_tokens=2),), preempted=(12,), resumed=(10,)))
    assert batch._row_of == {10: 0, 12: 2, 13: 1}  # the freed row is taken; preempted 12 keeps its row
    second = batch.step([13, 10])
    assert second is not first and second.rows == [1, 0] and second.sample_rows == [0] and second.min_tokens == [(0, 1)]
    assert second.params is not None and second.params.tolist() == [[1.0, NO_TOP_K, 1.0, pytest.approx(0.2)]]
    assert batch.short_rows(second) == [(0, [])]
    batch.accept(second, [5, 6])
    batch.accept(second, [5, 6])
    assert batch.short_rows(second) == []  # two output tokens: min_tokens met
    batch.clear()
    assert batch.num_rows == 0 and batch._row_of == {}


@pytest.fixture
def llm(tiny_model: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model("llama")), device="cpu", dtype="float32", block_size=4, num_kv_blocks=24, max_num_seqs=6)


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(2, 200) for _ in range(rng.randint(3, 30))] for _ in range(n)]


def test_decode_rows_are_released_when_sequences_finish_or_are_preempted(llm: LLM) -> None:
    runner, released = llm.engine.runner, []
    assert runner.backend.name == "cpu"  # decode rows: state per sequence, released from the diff
    release = runner.backend.decode_kv.release

    def spy(seq_ids: Any) -> None:
        released.append(tuple(seq_ids))
        release(seq_ids)

    runner.backend.decode_kv.release = spy  # type: ignore[method-assign]
    preempted: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def watch() -> ScheduledBatch:
        batch = schedule()
        preempted.extend(batch.update.preempted)
        return batch

    llm.engine.scheduler.schedule = watch  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(_prompts(8), params)
    assert preempted, "the pool was meant to be too small for every sequence at once"
    flat = [s for ids in released for s in ids]
    assert set(flat) == set(range(8)) | set(preempted)  # every finish, every preemption
    assert len(runner.backend.decode_kv._where) == 0 and runner.batch.num_rows == 0  # nothing left behind


def test_abort_all_leaves_every_owner_empty(llm: LLM) -> None:
    engine = llm.engine
    for prompt in _prompts(8):
        engine.add_request(prompt, SamplingParams(temperature=0.7, seed=1, max_tokens=20, n=2))
    for _ in range(6):
        engine.step()
    assert engine.runner.batch.num_rows and engine.runner.backend.decode_kv._where and engine.scheduler.has_unfinished()
    engine.abort_all()
    sched, bm = engine.scheduler, engine.scheduler.block_manager
    assert not sched.has_unfinished() and not sched._seqs and not sched.take_update()
    assert not bm._tables and bm.num_free_blocks == bm.num_blocks and not bm.hash_to_block
    assert engine.runner.batch.num_rows == 0 and not engine.runner.backend.decode_kv._where
    assert not engine.requests and not sched._special
    out = llm.generate(_prompts(2), SamplingParams(temperature=0.0, max_tokens=4))  # usable again
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_the_off_step_draw_applies_a_rows_features_once() -> None:
    """The hf backend's seeded draw: new rows join in the draw's own upload, and the engine's
    sampler applies their logits features (here a bias) as a step's draw does; clear frees them."""
    from batchgen.engine.sampling.sampler import Sampler, draw_now

    cpu = torch.device("cpu")
    sampler = Sampler([0], LogitsFeatures(None, 16, [0]))
    rows = SamplingBatch(cpu, sampler.features, Transfers(cpu))
    new = NewSequence(4, (1, 2), SamplingParams(temperature=1.0, seed=9, repetition_penalty=1.5, logit_bias={7: 50.0}))
    assert draw_now(sampler, rows, torch.zeros(1, 16), [4], [new]) == [7] and num_seeded(rows) == 1
    rows.clear()
    assert rows.num_rows == 0
