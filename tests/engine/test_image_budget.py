"""The scheduler's per-step image budget (core/image_budget): a step's chunks touch at most the
encoder cache's tokens and the decoded-pixel budget of images, a chunk ends before the image that
would overflow either, and the step's first image always runs (no deadlock on a large image)."""

from __future__ import annotations

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.image_budget import ImageBudget
from batchgen.engine.core.sequence import RequestExtras, Sequence


def seq(positions: tuple[tuple[int, int], ...], pixels: tuple[int, ...], atomic: bool = False) -> Sequence:
    s = Sequence(0, list(range(40)), SamplingParams(max_tokens=1))
    s.extras = RequestExtras(image_positions=positions, image_pixels=pixels, atomic_images=atomic)
    return s


def test_tokens_and_pixels_cut_chunks_before_the_overflowing_image() -> None:
    two = seq(((2, 8), (12, 8)), (100, 100))
    assert ImageBudget(16, 0, 1_000).step().cut(two, 0, 30) == 30  # both fit
    assert ImageBudget(12, 0, 1_000).step().cut(two, 0, 30) == 12  # tokens: ends where image 1 starts
    assert ImageBudget(16, 0, 150).step().cut(two, 0, 30) == 12  # pixels alike
    step = ImageBudget(12, 0, 1_000).step()
    assert step.cut(two, 0, 30) == 12
    assert step.cut(seq(((5, 8),), (10,)), 0, 30) == 5  # a second sequence's image waits for a later step
    assert step.cut(seq(((0, 8),), (10,)), 3, 30) == 0  # one that starts inside it gets nothing this step
    assert step.cut(seq((), ()), 0, 30) == 30  # text only: no charge


def test_the_steps_first_image_always_runs() -> None:
    big = seq(((0, 20),), (10_000_000,))
    step = ImageBudget(8, 0, 1_000).step()  # both budgets below the image
    assert step.cut(big, 0, 30) == 30
    assert step.cut(big, 0, 30) == 0  # (the same image again: a second charge does not fit)


def test_gemma3_rule_still_applies_and_a_cap_refuses_or_rises() -> None:
    atomic = seq(((4, 6),), (10,), atomic=True)
    assert ImageBudget(100, 0, 1_000).step().cut(atomic, 0, 7) == 4  # never ends inside the image
    fixed, auto = ImageBudget(10, 0, 1), ImageBudget(None, 10, 1)
    wide = seq(((0, 30),), (1,))
    assert "an image of 30 tokens does not fit the encoder cache (encoder_cache_tokens is 10)" in (
        fixed.check_image(wide) or ""
    )
    assert auto.check_image(wide) is None and auto.cache_tokens == 30
    step = auto.step()  # an automatic cap cuts no chunk for tokens (the runner evicts instead)
    assert step.cut(seq(((0, 30),), (0,)), 0, 40) == 40 and step.cut(seq(((0, 30),), (0,)), 0, 40) == 40
