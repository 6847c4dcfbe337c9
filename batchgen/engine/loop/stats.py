"""EngineStats: the engine's counters, for benchmarks and the job's logs."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from batchgen.engine.core.scheduler_output import ScheduledBatch


@dataclass
class EngineStats:
    """Counters a benchmark can read. Token counts are tokens run through the model."""

    steps: int = 0
    requests: int = 0
    errors: int = 0
    prefill_tokens: int = 0  # prompt chunks, and recomputation after preemption
    decode_tokens: int = 0  # decode chunks (scheduler.is_decode): one new token each
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, over finished requests
    output_tokens: int = 0  # sampled tokens
    preemptions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def count(self, batch: ScheduledBatch) -> None:
        """One step ran `batch`."""
        self.steps += 1
        for chunk in batch.chunks:
            if chunk.is_decode:
                self.decode_tokens += 1
            else:
                self.prefill_tokens += chunk.num_tokens
