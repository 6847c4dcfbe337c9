"""Scheduler: token-budget continuous batching with chunked prefill and preemption.

(Contract stub: ScheduledBatch is fixed; the Scheduler class is being written.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchgen.engine.sequence import Sequence


@dataclass
class ScheduledBatch:
    """One step's work. For seqs[i], the chunk to run is
    seqs[i].token_ids[seqs[i].num_computed_tokens : seqs[i].num_computed_tokens + num_new_tokens[i]]
    (num_computed_tokens is advanced by the engine AFTER the forward pass). A sequence needs a
    sampled token when its chunk reaches its last token.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def needs_sample(self, i: int) -> bool:
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens
