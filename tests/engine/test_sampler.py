"""Sampler: greedy exactness, what each filter may draw, frequencies, seeds, min_tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.scheduler_output import NewSequence
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.cpu import native
from batchgen.engine.cpu.argmax import native_greedy_ids
from batchgen.engine.sampling.batch import SamplingBatch
from batchgen.engine.sampling.penalties import LogitsFeatures
from batchgen.engine.sampling.sampler import NUCLEUS_WINDOW, Sampler, draw_now, greedy_ids
from batchgen.engine.staging.transfers import Transfers

VOCAB = 64
EOS = 3


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Small tensors: OpenMP threads only add barrier waits (seconds on a loaded 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Draw:
    """The sampler as the model runner uses it: rows of sampling state (made when a sequence is
    first seen, with as many tokens accepted as it has outputs), each call one draw_now."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.rows = SamplingBatch(torch.device("cpu"), sampler.features, Transfers(torch.device("cpu")))

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        for s in seqs:
            if s.seq_id not in self.rows._row_of:
                self.rows.add(NewSequence(s.seq_id, tuple(s.prompt_token_ids), s.params))
                for _ in range(s.num_output_tokens):  # min_tokens counts what the row accepted
                    draw_now(self.sampler, self.rows, torch.zeros(1, logits.shape[-1]), [s.seq_id])
        return draw_now(self.sampler, self.rows, logits, [s.seq_id for s in seqs])


def num_seeded(batch: SamplingBatch) -> int:
    """Rows that hold a generator of their own."""
    return sum(1 for r in batch._rows if r is not None and r.generator is not None)


def _features() -> LogitsFeatures:
    return LogitsFeatures(None, VOCAB, [EOS])


def seq(seq_id: int, outputs: int = 0, **params: Any) -> Sequence:
    s = Sequence(seq_id=seq_id, prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=1000, **params))
    s.token_ids.extend([5] * outputs)
    return s


def draws(logits_row: torch.Tensor, n: int, seed: int = 0, **params: Any) -> torch.Tensor:
    """n independent draws from one logits row: n unseeded rows in one call."""
    shared = SamplingParams(max_tokens=1000, **params)
    seqs = [Sequence(seq_id=i, prompt_token_ids=[1, 2], params=shared) for i in range(n)]
    return torch.tensor(Draw(Sampler([EOS], _features(), seed=seed))(logits_row.expand(n, -1), seqs))


def allowed(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """Slow per-row reference of the filters (transformers' order: top-k, top-p, min-p)."""
    probs = torch.softmax(row.double() / temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order[:top_k] if top_k else order
    total = sum(probs[t].item() for t in kept)
    nucleus, mass = [], 0.0
    for t in kept:
        if mass >= top_p * total and top_p < 1.0:
            break
        nucleus.append(t)
        mass += probs[t].item()
    best = probs[nucleus[0]].item()
    return {t for t in nucleus if probs[t].item() >= min_p * best}


def test_greedy_is_exact_argmax_of_raw_logits_in_a_mixed_batch() -> None:
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [seq(i, temperature=0.0 if i % 2 == 0 else 1.3, top_p=0.5) for i in range(40)]
    tokens = Draw(Sampler([EOS], _features(), seed=0))(logits, seqs)
    assert tokens[::2] == logits.argmax(dim=-1)[::2].tolist()


def test_greedy_ties_take_the_first_maximum() -> None:
    """As transformers' argmax does: of equal best logits, the lowest token id (rows of few values)."""
    logits = torch.randint(0, 3, (64, VOCAB), generator=torch.Generator().manual_seed(2)).float()
    tokens = Draw(Sampler([EOS], _features(), seed=0))(logits, [seq(i, temperature=0.0) for i in range(64)])
    rows = logits.tolist()
    assert tokens == [row.index(max(row)) for row in rows]


def _greedy_cases() -> list[torch.Tensor]:
    """[n, V] float32 logits: ties, rows of -inf, signed zeros, a NaN after the maximum, and one
    big enough for the kernel's two threads."""
    gen = torch.Generator().manual_seed(3)
    ties = torch.randint(0, 3, (16, 1000), generator=gen).float()
    ties[2] = float("-inf")
    ties[3, :500], ties[3, 500:] = -0.0, 0.0  # equal maxima of two signs: the first is kept
    ties[4, 7] = float("inf")
    nan = torch.randn(8, 300, generator=gen)
    nan[1, 200] = 1e30  # the maximum before the NaN: torch's max still gives the NaN's index
    nan[1, 250] = nan[5, 0] = nan[5, 299] = float("nan")
    return [ties, nan, torch.randn(64, 4096, generator=gen), torch.randn(1, 1, generator=gen)]


@pytest.mark.parametrize("case", range(len(_greedy_cases())))
def test_greedy_ids_are_torch_max_indices_with_a_nan_flag(case: int) -> None:
    """Through the native kernel on the CPU, as the torch fallback: torch.max(dim=-1)'s index."""
    logits = _greedy_cases()[case]
    expected_max, expected = logits.max(dim=-1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # why: the 64 x 4,096 case splits its rows between two threads
    try:
        ids, nan = greedy_ids(logits, native_greedy_ids)
    finally:
        torch.set_num_threads(threads)
    assert native.load() is not None, "the native kernel did not build: this test checks it"
    assert ids.dtype == torch.int64 and ids.tolist() == expected.tolist()
    assert bool(nan) == bool(expected_max.isnan().any())


def test_greedy_ids_of_strided_rows_read_only_each_rows_own_entries() -> None:
    """Rows further apart than the vocabulary (a slice of wider logits), and rows not contiguous (torch)."""
    wide = torch.randn(6, 130, generator=torch.Generator().manual_seed(4))
    wide[:, 100:] = 1e9  # beyond each row's 100 entries: never its maximum
    assert native_greedy_ids(wide[:, :100]) is not None  # the kernel reads these rows
    ids, nan = greedy_ids(wide[:, :100], native_greedy_ids)
    assert ids.tolist() == wide[:, :100].argmax(dim=-1).tolist() and not nan
    columns = wide[:, :100].t()  # [100, 6], stride (1, 130): the torch path
    assert native_greedy_ids(columns) is None
    ids, nan = greedy_ids(columns, native_greedy_ids)
    assert ids.tolist() == columns.argmax(dim=-1).tolist() and not nan


def test_top_k_1_equals_greedy() -> None:
    logits = torch.randn(200, VOCAB, generator=torch.Generator().manual_seed(1)) * 0.3
    seqs = [seq(i, temperature=2.0, top_k=1, seed=i if i % 3 == 0 else None) for i in range(200)]
    assert Draw(Sampler([EOS], _features(), seed=1))(logits, seqs) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab, scale", [(VOCAB, 2.0), (4096, 6.0)])  # full sort; best-1024 window
def test_each_row_draws_only_within_its_own_filters(vocab: int, scale: float) -> None:
    """Per-row top-k / top-p / min-p in one vectorized batch, checked against a slow reference."""
    rng = random.Random(2)
    configs = [
        dict(
            temperature=rng.choice([0.5, 1.0, 1.7]),
            top_k=rng.choice([0, 1, 3, 10]),
            top_p=rng.choice([1.0, 0.9, 0.5, 0.2]),
            min_p=rng.choice([0.0, 0.05, 0.3]),
        )
        for _ in range(12)
    ]
    rows = torch.randn(12, vocab, generator=torch.Generator().manual_seed(2)) * scale
    reps = 200  # every config repeated, so each row is drawn many times in one call
    logits = rows.repeat_interleave(reps, dim=0)
    seqs = [seq(i, **configs[i // reps]) for i in range(12 * reps)]
    tokens = Draw(Sampler([EOS], _features(), seed=2))(logits, seqs)
    for r, config in enumerate(configs):
        drawn = set(tokens[r * reps : (r + 1) * reps])
        ok = allowed(rows[r], **config)
        assert drawn <= ok, (config, drawn - ok)
        assert len(drawn) >= min(len(ok), 2) or len(ok) == 1  # the filter is not stricter than asked


def test_top_p_nucleus_wider_than_the_window_falls_back_to_a_full_sort() -> None:
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(6)) * 0.1  # nearly flat
    ok = allowed(logits, temperature=1.0, top_k=0, top_p=0.5, min_p=0.0)
    assert len(ok) > NUCLEUS_WINDOW + 200
    drawn = set(draws(logits, 600, top_p=0.5).tolist())
    window = set(logits.topk(NUCLEUS_WINDOW).indices.tolist())
    assert drawn <= ok and drawn - window  # tokens past the window are drawn, none past the nucleus


def test_top_p_never_draws_outside_the_nucleus() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    tokens = draws(probs.log(), 5000, top_p=0.75)
    assert set(tokens.tolist()) == {0, 1, 2}  # 0.4 + 0.25 < 0.75 <= 0.8: the third is needed


def test_top_k_draws_only_the_k_best() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    tokens = draws(logits, 5000, top_k=5, temperature=3.0)
    assert set(tokens.tolist()) == set(logits.topk(5).indices.tolist())


def test_min_p_never_draws_below_the_floor() -> None:
    probs = torch.tensor([0.5, 0.2, 0.12, 0.08, 0.05, 0.05])
    tokens = draws(probs.log(), 5000, min_p=0.2)  # floor 0.1
    assert set(tokens.tolist()) == {0, 1, 2}


def test_temperature_frequencies_match_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n, temperature = 40000, 0.7
    counts = torch.bincount(draws(logits, n, seed=4, temperature=temperature), minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * n
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 30.0  # 5 degrees of freedom: p ~ 1e-5 at 30
    hot = torch.bincount(draws(logits, n, seed=4, temperature=2.0), minlength=6)
    assert hot[0] < counts[0] and hot[5] > counts[5]  # temperature flattens


def _seeded_stream(steps: list[torch.Tensor], batch_size: int, order_seed: int) -> list[int]:
    """Tokens of request 'target' (seed 1234) over steps, surrounded by batch_size others."""
    rng = random.Random(order_seed)
    sampler = Draw(Sampler([EOS], _features(), seed=order_seed))
    target = seq(10_000, temperature=0.9, top_p=0.95, seed=1234)
    others = [
        seq(
            i,
            temperature=rng.choice([0.0, 0.5, 1.0]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.8]),
            seed=rng.choice([None, i]),
        )
        for i in range(batch_size)
    ]
    out = []
    for logits_row in steps:
        batch = [target, *others]
        rng.shuffle(batch)
        logits = torch.randn(len(batch), VOCAB, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        logits[batch.index(target)] = logits_row
        token = sampler(logits, batch)[batch.index(target)]
        target.token_ids.append(token)
        out.append(token)
    return out


def test_seeded_request_is_identical_alone_and_in_any_batch() -> None:
    steps = [torch.randn(VOCAB, generator=torch.Generator().manual_seed(s)) for s in range(30)]
    alone = _seeded_stream(steps, batch_size=0, order_seed=0)
    assert _seeded_stream(steps, batch_size=50, order_seed=1) == alone
    assert _seeded_stream(steps, batch_size=50, order_seed=2) == alone
    assert len(set(alone)) > 5  # it really samples


def test_release_drops_the_generator_and_a_new_request_restarts_it() -> None:
    sampler = Draw(Sampler([EOS], _features()))
    logits = torch.zeros(1, VOCAB)  # uniform: the draw is decided by the noise alone
    first = [sampler(logits, [seq(7, seed=99)])[0] for _ in range(5)]
    assert num_seeded(sampler.rows) == 1
    sampler.rows.remove([7])
    assert num_seeded(sampler.rows) == 0
    assert [sampler(logits, [seq(7, seed=99)])[0] for _ in range(5)] == first
    other = [sampler(logits, [seq(8, seed=100)])[0] for _ in range(5)]
    assert other != first


def test_min_tokens_masks_eos_and_stop_ids_then_lets_them_through() -> None:
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 50.0
    logits[:, 9] = 40.0  # a stop token id
    logits[:, 11] = 1.0  # the best remaining token
    seqs = [
        seq(0, outputs=1, temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        seq(1, outputs=1, temperature=1.0, min_tokens=2, stop_token_ids=[9], ignore_eos=True),
        seq(2, outputs=2, temperature=0.0, min_tokens=2, stop_token_ids=[9]),
        seq(3, outputs=0, temperature=0.0),
    ]
    before = logits.clone()
    tokens = Draw(Sampler([EOS], _features(), seed=5))(logits, seqs)
    assert tokens[0] == 11 and tokens[1] not in (EOS, 9)
    assert tokens[2] == EOS and tokens[3] == EOS
    assert torch.equal(logits, before)  # the caller's logits are untouched
    sampled = draws(logits[0], 3000, temperature=1.0, min_tokens=1, stop_token_ids=[9])
    assert not set(sampled.tolist()) & {EOS, 9}
