"""Greedy and the NaN check on bf16 logits, read in place: no float32 copy of a step's logits.

Exactness: the ids of bf16 logits are those of the same logits converted to float32 (ties: the first
maximum), through the native bf16 kernel and through torch's max alike; the engine hands the sampler
logits in the model's dtype, its one-read-per-step holds, and a NaN in bf16 logits stops the step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.cpu import argmax, native
from batchgen.engine.cpu.argmax import native_greedy_ids
from batchgen.engine.sampling.sampler import greedy_ids
from tests.engine.sync_counter import SyncCounter
from tests.engine.test_one_sync import CASES, _gpu_like, _run, _tokens


def _bf16_cases() -> list[torch.Tensor]:
    """[n, V] bf16 logits: ties (bf16's 8 bits of mantissa make them common), rows of -inf, signed
    zeros, +inf, NaN after the maximum, odd widths, and rows enough for the kernel's two threads."""
    gen = torch.Generator().manual_seed(5)
    ties = torch.randint(0, 3, (16, 1000), generator=gen).float()
    ties[2] = float("-inf")
    ties[3, :500], ties[3, 500:] = -0.0, 0.0
    ties[4, 7] = float("inf")
    rounded = torch.randn(8, 3001, generator=gen) * 1e-3 + 7.0  # rounds to a few bf16 values: many tied maxima
    nan = torch.randn(8, 301, generator=gen)
    nan[1, 200] = 1e30
    nan[1, 250] = nan[5, 0] = nan[5, 300] = float("nan")
    big = torch.randn(64, 4096, generator=gen)
    return [t.to(torch.bfloat16) for t in (ties, rounded, nan, big, torch.randn(1, 1, generator=gen))]


def _expected(logits: torch.Tensor) -> tuple[list[int], bool]:
    row_max, ids = logits.float().max(dim=-1)  # the float32 conversion: exact
    return ids.tolist(), bool(row_max.isnan().any())


@pytest.mark.parametrize("case", range(len(_bf16_cases())))
def test_bf16_ids_and_nan_flag_are_those_of_the_float32_conversion(case: int) -> None:
    logits = _bf16_cases()[case]
    want = _expected(logits)
    vocab = logits.shape[1]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # why: the 64 x 4,096 case splits its rows between two threads
    try:
        for native_wins in (True, False):  # both sides of the measured choice
            argmax._CHOSEN[vocab] = native_wins
            found = native_greedy_ids(logits)
            assert (found is not None) == native_wins, "the kernel must run exactly where it was chosen"
            ids, nan = greedy_ids(logits, native_greedy_ids)
            assert ids.dtype == torch.int64 and (ids.tolist(), bool(nan)) == want, native_wins
    finally:
        argmax._CHOSEN.pop(vocab, None)
        torch.set_num_threads(threads)
    kernel = native.function("batchgen_row_argmax", torch.bfloat16)
    assert kernel is not None, "the bf16 kernel did not build: this test checks it"


def test_the_measured_choice_reads_strided_bf16_rows() -> None:
    """A slice of wider bf16 logits (rows further apart than the vocabulary), whichever side wins."""
    wide = torch.randn(6, 130, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    wide[:, 100:] = 1e9  # beyond each row's 100 entries: never its maximum
    ids, nan = greedy_ids(wide[:, :100], native_greedy_ids)
    assert (ids.tolist(), bool(nan)) == _expected(wide[:, :100])


def _bf16_llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="bfloat16", block_size=4, compile=False, max_num_seqs=16)


@pytest.mark.parametrize("case", ["greedy", "logprobs", "bias_bans_allowed_min_tokens", "everything"])
def test_bf16_steps_read_once_and_draw_as_the_cpu_path(tiny_model_dir: Path, case: str) -> None:
    """The one-sync rule with bf16 logits; the CPU path's native bf16 greedy and the GPU-like path's
    torch max over the same bf16 logits give the same tokens and logprobs."""
    params = CASES[case]
    llm = _bf16_llm(tiny_model_dir)
    seen: list[torch.dtype] = []
    real = llm.engine.runner._logits
    llm.engine.runner._logits = lambda chunks: _noting(real(chunks), seen)  # type: ignore[method-assign]
    want, _ = _run(llm, params)
    assert seen and set(seen) == {torch.bfloat16}, "the sampler must be handed the model's bf16 logits"
    llm, counter = _bf16_llm(tiny_model_dir), SyncCounter()
    _gpu_like(llm, counter)
    with counter:
        got, steps = _run(llm, params)
    assert not counter.events, "\n".join(map(str, counter.events))
    assert all(uploads == 1 and reads <= 1 for uploads, reads, _ in steps), steps
    assert all(reads == 1 for _, reads, sampled in steps if sampled), steps
    assert _tokens(got, params) == _tokens(want, params)


def _noting(out: tuple[torch.Tensor, int], seen: list[torch.dtype]) -> tuple[torch.Tensor, int]:
    seen.append(out[0].dtype)
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=2),
        SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2),  # the NaN in a masked column
    ],
    ids=["sampled", "greedy", "greedy-masked"],
)
def test_a_nan_in_bf16_logits_stops_the_step(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, params: SamplingParams
) -> None:
    llm = LLM(str(tiny_model("llama")), device="cpu", dtype="bfloat16", block_size=8, num_kv_blocks=32, compile=False)
    runner = llm.engine.runner
    real = runner._logits
    column = min(llm.engine.eos_token_ids)

    def poisoned(chunks):  # type: ignore[no-untyped-def]
        logits, num_sampled = real(chunks)
        assert logits.dtype == torch.bfloat16
        logits = logits.clone()
        logits[-1, column] = float("nan")
        return logits, num_sampled

    monkeypatch.setattr(runner, "_logits", poisoned)
    with pytest.raises(RuntimeError, match="NaN logits"):
        llm.generate([[1, 2, 3], [4, 5]], params)
