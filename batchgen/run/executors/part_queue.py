"""Which part a Ray worker takes next: dynamic, so fast workers take more, and by group, so the
parts of one group of shared prefixes (prefix plan: consecutive parts, later ones `joined`) stay
on one worker and its prefix cache; contiguous parts (neighbours in the input) likewise.

The parts still to do are cut into one consecutive run per worker, never inside a group
(key_sort.run_bounds). A worker takes the next part of its own run; when its run is empty it
takes the last group of the longest remaining run (the parts furthest from where that run's owner
is working), the group's first part now and its other parts next, so stealing costs the owner no
locality and keeps the thief on one group. A part given back (its worker died) goes to the front
of the run, for the replacement worker.
"""

from __future__ import annotations

from collections import deque

from batchgen.inputs.key_sort import run_bounds
from batchgen.inputs.part_rows import GroupedPart, Part


def _joined(part: Part) -> bool:
    return isinstance(part, GroupedPart) and part.joined


class PartQueue:
    def __init__(self, parts: list[Part], workers: int) -> None:
        bounds = run_bounds([_joined(p) for p in parts], workers)
        self.runs = [deque(parts[bounds[w] : bounds[w + 1]]) for w in range(workers)]

    def next_for(self, slot: int) -> Part | None:
        """The next part for worker `slot`: its own run's first, else the first part of the longest
        run's last group (the rest of that group becomes its run); None when all are out."""
        own = self.runs[slot]
        if own:
            return own.popleft()
        longest = max(self.runs, key=len)
        if not longest:
            return None
        group = [longest.pop()]
        while longest and _joined(group[0]):
            group.insert(0, longest.pop())
        own.extend(group[1:])
        return group[0]

    def give_back(self, slot: int, part: Part) -> None:
        self.runs[slot].appendleft(part)

    def __len__(self) -> int:
        return sum(len(run) for run in self.runs)
