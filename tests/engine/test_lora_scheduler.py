"""Adapter slots in the scheduler: at most max_loras adapters per step, a slot of running or
preempted rows never given away, loads on demand in LRU order, every chunk naming its slot."""

from __future__ import annotations

import random

from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.adapter_slots import SlotTable
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.sequence import RequestExtras, Sequence, SequenceStatus

from .test_scheduler import step

A, B, C = b"adapter-a", b"adapter-b", b"adapter-c"


def test_slot_table_pins_and_evicts_least_recently_released() -> None:
    table = SlotTable(2)
    assert table.pin(A) == (0, True) and table.pin(B) == (1, True) and table.pin(A) == (0, False)
    assert not table.can_pin(C)  # both slots pinned
    table.unpin(B)
    table.unpin(A)
    assert table.can_pin(C) and table.pinned == {A: 1}
    table.unpin(A)
    assert table.pin(C) == (1, True)  # B was released first
    assert table.pin(A) == (0, False)  # still resident
    table.reset()
    assert table.pin(B) == (0, True)


def _scheduler(num_blocks: int, max_loras: int) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_seqs=6, max_num_batched_tokens=24, num_kv_blocks=num_blocks,
                          enable_lora=True, max_loras=max_loras)  # fmt: skip
    return Scheduler(config, BlockManager(num_blocks, 4, True), 4096)


def test_every_step_respects_the_slots_under_preemption() -> None:
    rng = random.Random(3)
    sched = _scheduler(num_blocks=14, max_loras=2)
    adapters = [A, B, C, b""]
    adapter_of: dict[int, bytes] = {}
    for i in range(30):
        adapter = rng.choice(adapters)
        seq = Sequence(
            i, [rng.randrange(5) for _ in range(rng.randrange(3, 20))], SamplingParams(max_tokens=rng.randrange(1, 9))
        )
        seq.extras = RequestExtras(adapter_hash=adapter)
        adapter_of[i] = adapter
        sched.add(seq)
    resident: dict[int, bytes] = {}  # slot -> adapter, as the runner would have loaded them
    seen = set()
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        admitted = {s.extras.adapter_hash for s in sched.running} | {
            s.extras.adapter_hash for s in sched.waiting if s.num_preemptions
        }
        batch = step(sched)
        for slot, adapter in batch.lora_loads:
            assert resident.get(slot) not in admitted - {b""}, "a pinned slot was given away"
            resident[slot] = adapter
        slots = {c.lora_slot for c in batch.chunks if c.lora_slot >= 0}
        assert len(slots) <= 2
        for chunk in batch.chunks:  # each chunk runs in the slot its adapter was loaded into
            adapter = adapter_of[chunk.seq_id]
            assert chunk.lora_slot == -1 if not adapter else resident[chunk.lora_slot] == adapter
        seen |= {len(batch.lora_loads)}
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert sched.slots is not None and sched.slots.pinned == {}
    assert max(seen) >= 1


def test_a_waiting_row_whose_adapter_finds_no_slot_waits_in_order() -> None:
    sched = _scheduler(num_blocks=64, max_loras=1)
    first, second, third = (Sequence(i, [1, 2, 3], SamplingParams(max_tokens=2)) for i in range(3))
    first.extras, second.extras, third.extras = (RequestExtras(adapter_hash=h) for h in (A, B, b""))
    for seq in (first, second, third):
        sched.add(seq)
    batch = step(sched)
    assert batch.seq_ids == [0] and batch.lora_loads == ((0, A),)  # B finds no slot; the base row waits behind it
    step(sched)  # first finishes: its slot is free again
    assert first.status is SequenceStatus.FINISHED
    batch = step(sched)
    assert batch.seq_ids == [1, 2] and batch.lora_loads == ((0, B),)
    assert [c.lora_slot for c in batch.chunks] == [0, -1]
