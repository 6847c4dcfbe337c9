"""One host sync per step: every host<->device transfer of a step goes through the runner's Transfers.

On CPU nothing is copied, but everything is counted the same way, and `copy=True` forces the
staging buffer path (what CUDA runs, without pinning) so its views and growth are checked here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention.planning import int64_tensor
from batchgen.engine.staging.transfers import Transfers

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]


def _llm(tiny_model: Callable[[str], Path], **settings: object) -> LLM:
    return LLM(str(tiny_model("llama")), device="cpu", dtype="float32", block_size=4, compile=False, **settings)


def _decode_step_counts(llm: LLM, params: SamplingParams) -> list[tuple[int, int]]:
    """(uploads, reads) of every step that is decode-only."""
    engine, counts = llm.engine, llm.engine.runner.transfers.counts
    for p in PROMPTS:
        engine.add_request(p, params)
    per_step = []
    while engine.has_unfinished():
        decode_only = not engine.scheduler.waiting and all(
            s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running
        )
        before = (counts.uploads, counts.reads)
        engine.step()
        after = (counts.uploads, counts.reads)
        if decode_only:
            per_step.append((after[0] - before[0], after[1] - before[1]))
    return per_step


def test_greedy_decode_step_is_one_upload_and_one_read(tiny_model: Callable[[str], Path]) -> None:
    llm = _llm(tiny_model)
    steps = _decode_step_counts(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(steps) >= 4
    assert set(steps) == {(1, 1)}, steps
    assert set(llm.engine.runner.transfers.counts.read_sites) == {"sampled_ids"}


def test_sampling_features_cost_no_more_uploads(tiny_model: Callable[[str], Path]) -> None:
    """Per-row sampling parameters and min_tokens masks are staged with the step's metadata: one
    upload, one read, whatever the features (tests/engine/test_one_sync.py checks every feature)."""
    sampled = _decode_step_counts(_llm(tiny_model), SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=4))
    assert set(sampled) == {(1, 1)}, sampled
    ragged = _decode_step_counts(
        _llm(tiny_model), SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=4, min_tokens=4)
    )
    assert set(ragged) == {(1, 1)}, ragged
    masked = _decode_step_counts(
        _llm(tiny_model), SamplingParams(temperature=0.0, min_tokens=3, max_tokens=3, ignore_eos=True)
    )
    assert set(masked) == {(1, 1)}, masked


def test_staging_buffer_path_gives_the_same_tokens(tiny_model: Callable[[str], Path]) -> None:
    """The copy path (one buffer, views filled by one upload; grown when a step needs more) = direct tensors."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in _llm(tiny_model).generate(PROMPTS, params)]
    llm = _llm(tiny_model)
    runner = llm.engine.runner
    runner.transfers = Transfers(torch.device("cpu"), copy=True, capacity=16)  # too small: grows in the first step
    runner.batch.transfers = runner.transfers
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
    assert runner.transfers._arenas[0].host.numel() > 16


def test_staged_values_arrive_with_the_upload() -> None:
    transfers = Transfers(torch.device("cpu"), copy=True, capacity=4)
    a = transfers.stage(torch.tensor([1, 2, 3]))
    b = transfers.stage(torch.tensor([[4, 5], [6, 7]]))  # does not fit: a second buffer for this step
    transfers.upload()
    assert a.tolist() == [1, 2, 3] and b.tolist() == [[4, 5], [6, 7]]
    assert transfers.counts.uploads == 2  # one copy per buffer in the step that grew
    transfers.begin_step()
    c = transfers.stage(torch.tensor([8, 9, 10, 11, 12, 13, 14]))
    transfers.upload()
    assert c.tolist() == [8, 9, 10, 11, 12, 13, 14] and transfers.counts.uploads == 3  # one buffer again


@pytest.mark.parametrize("copy", [False, True])
def test_read_is_one_transfer_for_several_tensors(copy: bool) -> None:
    """Integers, flags and floats (float32 exactly) come back from one read."""
    transfers = Transfers(torch.device("cpu"), copy=copy)
    values = torch.tensor([0.1, -2.5e-8, float("-inf")])
    ids, flag, floats = transfers.read("sampled_ids", torch.tensor([3, 1, 2]), torch.tensor(True), values)
    assert (ids, flag) == ([3, 1, 2], [1])
    assert floats == values.tolist()  # the float32 values, widened exactly
    assert transfers.counts.reads == 1 and transfers.counts.read_sites == {"sampled_ids": 1}


@pytest.mark.parametrize("copy", [False, True])
def test_staged_floats_bools_and_kept_values(copy: bool) -> None:
    """Floats and bools keep their dtype; a kept value outlives the step; device work queued with
    on_upload runs right after the copy, in order."""
    transfers = Transfers(torch.device("cpu"), copy=copy, capacity=2)
    kept = transfers.stage(torch.tensor([[0.5, 2.0]]), keep=True)
    flags = transfers.stage(torch.tensor([True, False, True]))
    ints = transfers.stage(torch.tensor([7, 8], dtype=torch.int32))
    done: list[str] = []
    transfers.on_upload(lambda: done.append(f"{ints.tolist()}"))
    transfers.upload()
    assert kept.dtype == torch.float32 and flags.dtype == torch.bool and ints.dtype == torch.int64
    assert kept.tolist() == [[0.5, 2.0]] and flags.tolist() == [True, False, True] and done == ["[7, 8]"]
    transfers.begin_step()
    transfers.stage(torch.tensor([9.0, 9.0]))  # the buffer is written from its start again
    transfers.upload()
    assert kept.tolist() == [[0.5, 2.0]]


def test_a_second_upload_in_a_step_sends_only_what_came_after_the_first() -> None:
    """A step that uploads twice (a CUDA graph that did not fit, then the general path) keeps the
    views of its first upload valid."""
    transfers = Transfers(torch.device("cpu"), copy=True)
    first = transfers.stage(torch.tensor([1, 2, 3]))
    transfers.upload()
    second = transfers.stage(torch.tensor([4, 5]))
    transfers.upload()
    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5]
    assert transfers.counts.uploads == 2


def test_int64_tensor_holds_the_values_after_the_list_is_gone() -> None:
    """The step's metadata tensors come from arrays (transfers.int64_tensor): same values and dtype
    as torch.tensor, including values past 32 bits and -1 (the padding slot), and none when empty."""
    import gc

    values = [0, 7, -1, 2**40 + 3]
    made = int64_tensor(list(values))
    gc.collect()  # why: the array behind the tensor must live as long as the tensor does
    assert made.dtype == torch.int64 and made.shape == (4,)
    assert torch.equal(made, torch.tensor(values))
    empty = int64_tensor([])
    assert empty.dtype == torch.int64 and empty.shape == (0,)
