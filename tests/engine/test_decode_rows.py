"""DecodeRows: rows are reused while a sequence keeps decoding, refilled when out of step, and exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention.decode_kv import DecodeRequest
from batchgen.engine.cpu import native
from batchgen.engine.cpu.decode_rows import DecodeRows
from batchgen.engine.cpu.row_pack import MIN_CLASS_LEN, length_class, row_class
from batchgen.engine.platforms import platform_for

BLOCK, KVH, DIM = 4, 2, 8


def _rows(**limits: int) -> DecodeRows:
    """One-layer rows for the native kernel; `limits` are DecodeRows' max_rows / pool_tokens."""
    assert native.load() is not None, "the native kernel did not build (see the log)"
    return DecodeRows(1, KVH, DIM, BLOCK, 4096, torch.float32, torch.device("cpu"), **limits)


def _host(t: torch.Tensor) -> torch.Tensor:
    """The CPU's stage: a step's upload leaves host tensors where they are."""
    return t


def _fill_seq_ids(view: object) -> list[tuple[int, int]]:
    return [(row, length) for step in view.classes for row, length, _ in step.fills]  # type: ignore[attr-defined]


def test_length_classes() -> None:
    assert [
        length_class(n) for n in (1, MIN_CLASS_LEN, MIN_CLASS_LEN + 1, 2 * MIN_CLASS_LEN, 2 * MIN_CLASS_LEN + 1)
    ] == [0, 0, 1, 1, 2]


def test_rows_are_kept_while_decoding_and_refilled_when_out_of_step() -> None:
    rows = _rows()
    table = list(range(64))
    order, view = rows.plan([DecodeRequest(7, 10, table), DecodeRequest(8, 20, table)], _host)
    assert order == [0, 1] and _fill_seq_ids(view) == [(0, 10), (1, 20)]
    order, view = rows.plan([DecodeRequest(7, 11, table), DecodeRequest(8, 21, table)], _host)
    assert _fill_seq_ids(view) == [] and rows.num_fills == 2  # both kept, nothing copied
    # seq 7 sits a step out (a budget-limited step): it keeps its row
    order, view = rows.plan([DecodeRequest(8, 22, table)], _host)
    assert len(rows._where) == 2 and _fill_seq_ids(view) == []
    # it comes back at another position (preempted, prefilled again): the row is stale, refilled
    order, view = rows.plan([DecodeRequest(7, 30, table), DecodeRequest(8, 23, table)], _host)
    assert _fill_seq_ids(view) == [(0, 30)]
    # a position that does not follow the row's length means the row is stale: refill
    order, view = rows.plan([DecodeRequest(7, 30, table), DecodeRequest(8, 24, table)], _host)
    assert _fill_seq_ids(view) == [(0, 30)]


def test_the_native_kernels_rows_keep_their_place_and_a_new_sequence_takes_a_hole() -> None:
    rows = _rows()
    table = list(range(64))
    rows.plan([DecodeRequest(s, 10, table) for s in (1, 2, 3)], _host)
    # seq 1 finished: the others keep rows 1 and 2 (nothing moved or refilled), row 0 is a hole
    rows.release([1])
    assert rows._where == {2: (0, 1), 3: (0, 2)}
    order, view = rows.plan([DecodeRequest(2, 11, table), DecodeRequest(3, 11, table)], _host)
    assert view.native is not None and list(view.classes[0].fills) == [] and rows.num_fills == 3
    assert rows._where == {2: (0, 1), 3: (0, 2)}
    order, view = rows.plan(
        [DecodeRequest(4, 20, table), DecodeRequest(2, 12, table), DecodeRequest(3, 12, table)], _host
    )
    assert rows._where[4] == (0, 0) and _fill_seq_ids(view) == [(0, 20)]
    assert order == [0, 1, 2]  # packed by row


def _plan_fields(order: list[int], view: object) -> tuple[object, ...]:
    """What a plan decides, addresses aside: the order, each class's rows and fills, and the
    kernel's per-decode class, row, class length, length and shared prefix."""
    step = view.native  # type: ignore[attr-defined]
    n = step.num_decodes
    classes = [(c.num_rows, [(r, length) for r, length, _ in c.fills]) for c in view.classes]  # type: ignore[attr-defined]
    return order, classes, step.table[: 5 * n].tolist()


def test_a_step_that_repeats_the_last_one_position_on_is_planned_as_in_full() -> None:
    """The same decodes at the next positions reuse the last plan (its NativeStep, advanced); any
    other step is planned in full, and both give what a full plan gives."""
    shared = list(range(100))  # seqs 1 and 2 share their first blocks (a cached prompt)
    own = list(range(100, 200))  # seq 3, in the next length class
    steps = [
        [(1, 11, shared), (2, 11, shared), (3, 80, own)],
        [(1, 12, shared), (2, 12, shared), (3, 81, own)],  # a repeat, sharing a block more
        [(1, 13, shared), (2, 13, shared), (3, 82, own)],  # a repeat
        [(1, 15, shared), (3, 83, own)],  # seq 2 finished
        [(1, 16, shared), (3, 84, own)],  # a repeat again
        [(3, 85, own), (1, 17, shared)],  # another order
        [(3, 86, own), (1, 19, shared)],  # seq 1 skipped a position: refilled
        [(3, 2 * MIN_CLASS_LEN, own), (1, 20, shared)],  # seq 3 outgrows its class
    ]
    reused, full = _rows(), _rows()
    last = None
    repeats, prefixes = [], []
    for i, step in enumerate(steps):
        if i == 3:  # seq 2 finished: the engine says so
            reused.release([2])
            full.release([2])
        decodes = [DecodeRequest(s, p, t) for s, p, t in step]
        order, view = reused.plan(decodes, _host)
        assert view.native is not None
        repeats.append(view.native is last)
        prefixes.append(view.native.shared.tolist())
        last = view.native
        full._repeat = None  # why: the reference is always planned in full
        assert _plan_fields(order, view) == _plan_fields(*full.plan(decodes, _host))
    assert repeats == [False, True, True, False, True, False, False, False]
    assert [p[:2] for p in prefixes[:3]] == [[8, 8], [12, 12], [12, 12]]  # rewritten in the repeats


def test_outgrowing_a_class_moves_to_the_next_and_packs_by_class() -> None:
    rows = _rows()
    table = list(range(200))
    rows.plan([DecodeRequest(1, MIN_CLASS_LEN - 1, table), DecodeRequest(2, 5, table)], _host)
    order, view = rows.plan([DecodeRequest(1, MIN_CLASS_LEN, table), DecodeRequest(2, 6, table)], _host)
    # seq 1 now needs MIN_CLASS_LEN + 1 tokens: class 1, refilled; class 0 is packed first
    assert order == [1, 0]
    assert [step.cap for step in view.classes] == [MIN_CLASS_LEN, 2 * MIN_CLASS_LEN]
    assert _fill_seq_ids(view) == [(0, MIN_CLASS_LEN)]


def test_rows_and_block_gathers_give_the_same_tokens(tiny_model: Callable[[str], Path]) -> None:
    """Mixed lengths, joins, finishes, chunked prefill and preemption: rows on CPU vs gathered blocks."""
    prompts = [[(i * 7 + j) % 250 + 2 for j in range(5 + 23 * i)] for i in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * (i % 4), ignore_eos=True) for i in range(12)]
    outputs = []
    for backend in ("cpu", "torch"):
        llm = LLM(
            str(tiny_model("mistral")),
            block_size=8,
            max_num_batched_tokens=48,
            max_num_seqs=6,
            num_kv_blocks=40,
            attention_backend=backend,
        )
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        source = llm.engine.runner.backend.decode_kv
        assert isinstance(source, DecodeRows) == (backend == "cpu")
        if isinstance(source, DecodeRows):
            assert 0 < source.num_fills < llm.stats["decode_tokens"]
            assert llm.stats["preemptions"] > 0
    assert outputs[0] == outputs[1]


def test_long_classes_reserve_only_the_rows_the_pool_can_fill() -> None:
    rows = _rows(max_rows=64, pool_tokens=1000)
    table = list(range(300))
    rows.plan([DecodeRequest(1, 10, table), DecodeRequest(2, 600, table)], _host)
    shapes = {c: pack.k[0].shape[0] for c, pack in rows._packs.items()}
    # class 0 may seat all 64; a sequence in class 4 holds > 256 tokens (it may have come one class
    # early, see row_class), so a 1000-token pool fits 3
    assert shapes == {0: 64, length_class(601): 1000 // (4 * MIN_CLASS_LEN + 1) + 1}


def test_a_row_comes_one_class_early_when_its_sequence_can_only_end_there() -> None:
    assert row_class(MIN_CLASS_LEN - 4, MIN_CLASS_LEN + 20) == 1  # ends within class 1: placed there now
    assert row_class(MIN_CLASS_LEN - 4, MIN_CLASS_LEN - 1) == 0  # fits its own class
    assert row_class(MIN_CLASS_LEN - 4, 4 * MIN_CLASS_LEN) == 0  # may outgrow the next too: no early move
    assert row_class(MIN_CLASS_LEN - 4, 0) == 0  # its end unknown
    rows = _rows()
    table = list(range(64))
    # a prompt 4 tokens below class 0's end that may grow 20 more: one fill, kept as it crosses
    near = MIN_CLASS_LEN - 4
    for step in range(8):
        order, view = rows.plan(
            [DecodeRequest(3, near + step, table, near + 20), DecodeRequest(4, 10 + step, table)], _host
        )
        assert order == [1, 0] and [c.cap for c in view.classes] == [MIN_CLASS_LEN, 2 * MIN_CLASS_LEN]
    assert rows.num_fills == 2


def test_auto_means_rows_on_cpu_and_a_bad_setting_is_refused(tiny_model: Callable[[str], Path]) -> None:
    assert platform_for(torch.device("cpu")).attention_backend("auto") == "cpu"
    assert platform_for(torch.device("cuda")).attention_backend("auto") == "torch"
    assert platform_for(torch.device("cpu")).attention_backend("torch") == "torch"
    with pytest.raises(ValueError, match="runs on the CPU, not on cuda"):
        platform_for(torch.device("cuda")).attention_backend("cpu")
    assert isinstance(LLM(str(tiny_model("llama")), num_kv_blocks=16).engine.runner.backend.decode_kv, DecodeRows)
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="rows")  # type: ignore[arg-type]
