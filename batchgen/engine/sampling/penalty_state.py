"""PenaltyTables: the device-side token history that repetition, presence and frequency penalties read.

Why one table of slots: rows own a slot of two [slots, V] tables (seen in prompt + output; output
counts); a step gathers its slots with one staged index and counts the sampled ids in one indexed
write on the device, so no host value is needed.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from batchgen.engine.staging.transfers import Transfers


class PenaltyTables:
    """Slots of seen [slots, V] bool (prompt + output) and counts [slots, V] float32 (output), on the device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self._free: list[int] = []  # released slots, lowest first
        self._used = 0  # slots ever handed out (the tables' rows in use or free)

    @property
    def num_slots(self) -> int:
        return self._used - len(self._free)

    def take(self, prompt_token_ids: Sequence[int], staging: Transfers) -> int:
        """A slot for a new row: zeroed, its prompt's tokens marked seen after this step's upload."""
        slot = heapq.heappop(self._free) if self._free else self._grow()
        prompt = staging.stage(torch.tensor(list(prompt_token_ids), dtype=torch.int64))  # [P]

        def fill() -> None:
            self.seen[slot] = False
            self.counts[slot] = 0.0
            self.seen[slot, prompt] = True

        staging.on_upload(fill)
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def clear(self) -> None:
        self._free, self._used = [], 0

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each slot takes its row's sampled token (slots, tokens: [k] on the device).

        Why scatter_add_ on the flat table, not index_put_(accumulate=True): on CUDA the latter
        reads its indices' min and max back to the host, a second sync every decode step (the GPU
        check's profiler counted it); scatter_add_ checks its bounds on the device."""
        self.seen[slots, tokens] = True
        flat = slots * self.vocab_size + tokens  # [k]
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(tokens, dtype=torch.float32))

    def _grow(self) -> int:
        slot = self._used
        self._used += 1
        if slot == self.seen.shape[0]:  # why doubling: a device allocation and copy, rarely
            size = max(8, 2 * slot)
            seen = torch.zeros((size, self.vocab_size), dtype=torch.bool, device=self.device)
            counts = torch.zeros((size, self.vocab_size), dtype=torch.float32, device=self.device)
            seen[:slot] = self.seen
            counts[:slot] = self.counts
            self.seen, self.counts = seen, counts
        return slot
