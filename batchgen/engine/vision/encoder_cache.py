"""The encoder cache: image embeddings by content hash, bounded by a cap in image tokens.

Why a cap and eviction: an image's embeddings are kept from the step whose chunk first covers it
until every sequence that needs them has prefilled past it (vision/encoder), which with chunk
cuts, shared images and preempted sequences waiting to recompute could hold many images. Entries
leave in this order when a step's new embeddings need room: those no sequence still claims
(least recently used first), then those only sequences outside this step still need (least
recently used first; such a sequence runs the tower again when its next chunk covers the image:
the same pixels through the same modules, so the same embeddings). What the step itself splices
from is never evicted. Under a cap the user set (encoder_cache_tokens), the scheduler charges a
step's chunks at most the cap (core/image_budget), so the cache never holds more than it; the
automatic cap (max_num_batched_tokens, raised to the largest image seen) is left by at most the
images of one step, which are never cut for it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    """content hash -> embeddings [tokens, hidden], at most `cap` tokens in all."""

    def __init__(self, cap: int, auto: bool) -> None:
        self.cap, self.auto = cap, auto
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.used = 0  # tokens held
        self.peak = 0  # the most tokens ever held (tests, benchmarks)
        self.evicted = 0  # entries evicted while some sequence still needed them

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, content_hash: bytes) -> bool:
        return content_hash in self.entries

    def get(self, content_hash: bytes) -> torch.Tensor:
        """The embeddings of a cached image, now the most recently used."""
        self.entries.move_to_end(content_hash)
        return self.entries[content_hash]

    def fit(self, tokens: int) -> None:
        """An image of `tokens` arrived: an automatic cap rises to hold it (as the scheduler's does)."""
        if self.auto and tokens > self.cap:
            self.cap = tokens

    def make_room(self, tokens: int, keep: set[bytes], claimed: Callable[[bytes], bool]) -> None:
        """Evict until `tokens` more fit under the cap, never an entry in `keep`: unclaimed ones
        first, then claimed ones (their sequences recompute them)."""
        for needed in (False, True):
            for content_hash in [h for h in self.entries if h not in keep and claimed(h) == needed]:
                if self.used + tokens <= self.cap:
                    return
                self.pop(content_hash)
                self.evicted += int(needed)

    def put(self, content_hash: bytes, embeds: torch.Tensor) -> None:
        self.pop(content_hash)
        self.entries[content_hash] = embeds
        self.used += int(embeds.shape[0])
        self.peak = max(self.peak, self.used)

    def pop(self, content_hash: bytes) -> None:
        gone = self.entries.pop(content_hash, None)
        if gone is not None:
            self.used -= int(gone.shape[0])

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0
