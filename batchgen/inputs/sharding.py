"""Static shards (`batchgen run JOB --shard I/N`): which parts one of N independent processes
owns, for Airflow task mapping, Slurm/Kubernetes job arrays or cron on several boxes.

The rule: part `p` belongs to shard `p % N`, with I counted from 0 (shards 0/N .. N-1/N). The
part index is global (it depends on the job only), so N processes need no coordination beyond
the output folder, and N may change between runs of one output: a part is committed once,
whichever shard computes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SPEC = re.compile(r"\s*(\d+)\s*/\s*(\d+)\s*")


@dataclass(frozen=True)
class ShardSpec:
    index: int  # 0-based: 0 .. count - 1
    count: int

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        """`"I/N"` -> ShardSpec; a ValueError that says what is wrong otherwise."""
        match = _SPEC.fullmatch(text)
        if not match:
            raise ValueError(f"{text!r} is not I/N (e.g. 0/4: shard 0 of 4; shards count from 0)")
        index, count = int(match.group(1)), int(match.group(2))
        if count < 1:
            raise ValueError(f"{text!r}: the number of shards N must be at least 1")
        if index >= count:
            raise ValueError(f"{text!r}: shards count from 0, so I must be below N (0 to {count - 1})")
        return cls(index, count)

    def owns(self, part_index: int) -> bool:
        return part_index % self.count == self.index

    @property
    def lock_name(self) -> str:
        return f".batchgen.shard-{self.index}-of-{self.count}.lock"

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"
