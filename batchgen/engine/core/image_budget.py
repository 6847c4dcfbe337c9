"""What one step's chunks may touch of their requests' images: at most `cache_tokens` image tokens
(the encoder cache must hold every image a step's chunks splice from) and at most `pixels` decoded
pixels (an image not in the encoder cache is decoded in the step whose chunk first covers it, and
its pixels live until the tower has run on it, in that step).

Why in the scheduler: the runner decodes and caches what the step's chunks need, so only the
choice of chunks bounds that memory. A chunk that would overflow either budget ends before the
image (vLLM's encoder budget cuts chunks alike); the step's first image is always allowed, so one
image larger than a budget never deadlocks (an image above a cap the user set is refused at add:
`check_image`). Counts are conservative: an image is charged whenever a chunk overlaps it, cached
or not, and once per sequence; which is why tokens are charged only under a cap the user set.
"""

from __future__ import annotations

from batchgen.engine.core.sequence import Sequence

UNLIMITED = 1 << 62


class ImageBudget:
    """The caps (the engine's settings, `cache_tokens` raised as larger images arrive when auto)."""

    def __init__(self, cache_tokens: int | None, default_tokens: int, pixels: int) -> None:
        self.auto = cache_tokens is None
        self.cache_tokens = default_tokens if cache_tokens is None else cache_tokens
        self.pixels = pixels

    def check_image(self, seq: Sequence) -> str | None:
        """Why `seq` can never run under the cache cap, or None (auto: the cap rises to its largest image)."""
        largest = max((count for _, count in seq.extras.image_positions), default=0)
        if largest <= self.cache_tokens:
            return None
        if self.auto:
            self.cache_tokens = largest
            return None
        return (
            f"request {seq.seq_id}: an image of {largest} tokens does not fit the encoder cache "
            f"(encoder_cache_tokens is {self.cache_tokens}); raise encoder_cache_tokens"
        )

    def step(self) -> StepImages:
        """A step's budgets. An automatic cap charges no tokens: the scheduler cannot see which
        images are cached, and charging a chunk cut through one its whole image again would leave
        steps underfilled; the cache then evicts down to its cap all but the step's own images."""
        return StepImages(UNLIMITED if self.auto else self.cache_tokens, self.pixels)


class StepImages:
    """One step's charges; `cut` shortens a chunk to what the budgets (and Gemma 3's rule) allow."""

    def __init__(self, cache_tokens: int, pixels: int) -> None:
        self.tokens_left, self.pixels_left = cache_tokens, pixels
        self.any = False  # an image was charged in this step: later ones must fit

    def cut(self, seq: Sequence, start: int, n: int) -> int:
        """`n`, or fewer: the chunk [start, start + n) of `seq` ends before the first image that
        would overflow a budget, and never inside an image whose tokens attend both ways
        (RequestExtras.atomic_images). Charges the images the returned chunk overlaps."""
        n = cut_before_image(seq, start, n)
        extras = seq.extras
        if not extras.image_positions:
            return n
        pixels = extras.image_pixels or (0,) * len(extras.image_positions)
        end = start + n
        for (first, count), size in zip(extras.image_positions, pixels):
            if first >= end or first + count <= start:
                continue
            fits = count <= self.tokens_left and size <= self.pixels_left
            if self.any and not fits:
                return max(0, first - start)  # 0: it starts inside this image; it waits for a step
            self.any = True
            self.tokens_left -= count
            self.pixels_left -= size
        return n


def cut_before_image(seq: Sequence, start: int, n: int) -> int:
    """`n`, or fewer so that a chunk from `start` never ends inside an image whose tokens attend
    both ways (RequestExtras.atomic_images): it ends at that image's start, or 0 when it starts
    inside the image and cannot finish it within `n`."""
    if not seq.extras.atomic_images:
        return n
    end = start + n
    for first, count in seq.extras.image_positions:
        if first < end < first + count:
            return max(0, first - start)
    return n
