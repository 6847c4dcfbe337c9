"""Which part a Ray worker takes next: dynamic, so fast workers take more, and contiguous, so
neighbouring parts (which share prefixes: windows follow the input order, each ordered by prefix)
stay on one worker and its prefix cache.

The parts still to do are cut into one contiguous run per worker. A worker takes the next part
of its own run; when its run is empty it takes the last part of the longest remaining run (the
part furthest from where that run's owner is working), so stealing costs the owner no locality.
A part given back (its worker died) goes to the front of the run, for the replacement worker.
"""

from __future__ import annotations

from collections import deque

from batchgen.inputs.dataset import Shard


class PartQueue:
    def __init__(self, parts: list[Shard], workers: int) -> None:
        n = len(parts)
        self.runs = [deque(parts[w * n // workers : (w + 1) * n // workers]) for w in range(workers)]

    def next_for(self, slot: int) -> Shard | None:
        """The next part for worker `slot`: its own run's first, else the longest run's last; None when all are out."""
        own = self.runs[slot]
        if own:
            return own.popleft()
        longest = max(self.runs, key=len)
        return longest.pop() if longest else None

    def give_back(self, slot: int, part: Shard) -> None:
        self.runs[slot].appendleft(part)

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs)
