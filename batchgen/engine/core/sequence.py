"""Sequence: one request's state inside the engine (tokens, progress, KV blocks, usage).

`num_computed_tokens` (K/V in the cache) catches up with `num_tokens`, a chunk at a time. The
scheduler is the only writer; the blocks are the block manager's; the runner never sees this object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from batchgen.engine.api.params import SEED_MAX, SamplingParams


@dataclass(frozen=True)
class RequestExtras:
    """What a request adds to its tokens, as data that rides in the scheduler's output
    (NewSequence), never a callback: its adapter (LoRA) by content hash, its images (each one's
    content hash and the positions its embeddings fill) and multi-axis rotary positions (M-RoPE:
    [axes][prompt tokens]). The hashes join the request's block hashes (core/block_hash: the one
    rule). Which slot an adapter occupies is the step's business, not the request's: slots change
    as adapters load and leave, a request's content does not."""

    adapter_hash: bytes = b""  # content hash of the request's adapter; b"": the base model
    image_hashes: tuple[bytes, ...] = ()
    image_positions: tuple[tuple[int, int], ...] = ()  # (first position, count) per image
    rotary_positions: tuple[tuple[int, ...], ...] = ()
    # the images themselves (engine/vision/images.RequestImage, pixels decoded only when the tower
    # runs): data for the runner side, not part of what the request is compared by
    images: tuple[Any, ...] = field(default=(), compare=False)
    # each image's decoded size, width x height (the scheduler's per-step pixel budget: core/image_budget)
    image_pixels: tuple[int, ...] = field(default=(), compare=False)
    # the images' tokens attend to each other both ways (Gemma 3): no chunk may end inside one
    atomic_images: bool = False
    # every prompt position's output is wanted (mean or CLS pooling): no prefix comes from the cache
    uncached: bool = False


NO_EXTRAS = RequestExtras()


def fork_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params: seed + index (vLLM's rule) wrapped into 64 bits, one sample, no prompt
    logprobs (the parent takes them)."""
    seed = None if params.seed is None else params.seed + index
    if seed is not None and seed > SEED_MAX:
        seed -= 1 << 64
    return dataclasses.replace(params, seed=seed, n=1, prompt_logprobs=None)


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(init=False)  # prompt + generated so far
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the paged cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_preemptions: int = 0
    extras: RequestExtras = NO_EXTRAS

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence may ever hold in the cache: prompt + max_tokens (resolved by the engine)."""
        return len(self.prompt_token_ids) + (self.params.max_tokens or 0)

    @property
    def seats(self) -> int:
        """Running seats this sequence takes: n while its samples are still to be forked from it."""
        n = self.params.n
        return n if n > 1 and self.num_output_tokens == 0 and self.params.max_tokens != 0 else 1
