"""ShardedRunner: rank 0's model runner, which sends every call that moves runner state to the workers.

Why a subclass: rank 0 runs the single-device code over its shard, unseen by the engine. Workers
get the construction arguments (no sampler), each step's frozen batch (a few KB, sent before rank 0
runs it), the diffs between steps, and drop-all; rank 0 alone draws from the gathered logits.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from batchgen.engine.core.runner_output import ModelRunnerOutput
from batchgen.engine.core.scheduler_output import BatchUpdate, ScheduledBatch
from batchgen.engine.parallel.collectives import CollectiveError
from batchgen.engine.parallel.group import DEATH_WAIT_S, TensorParallelError, TensorParallelGroup
from batchgen.engine.runner.model_runner import ModelRunner


class ShardedRunner(ModelRunner):
    def __init__(self, group: TensorParallelGroup, model: PreTrainedModel, *args: Any, **kwargs: Any) -> None:
        """`args`, `kwargs`: ModelRunner's after the model (spec, config, num_kv_blocks, device, dtype, ...)."""
        self.group = group
        group.send(("build", args, {k: v for k, v in kwargs.items() if k != "sampler"}))
        super().__init__(model, *args, **kwargs)

    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        self.group.check()
        try:
            self.group.send(("execute", batch))
            return super().execute(batch)
        except BaseException as exc:
            wait = DEATH_WAIT_S if isinstance(exc, CollectiveError) else 0.0
            why = self.group.dead(wait) or f"rank 0 failed in a step ({type(exc).__name__}: {exc})"
            self.group.fail(why)
            if isinstance(exc, Exception) and not isinstance(exc, TensorParallelError):
                raise TensorParallelError(why) from exc
            raise

    def apply(self, update: BatchUpdate) -> None:
        if update:
            self.group.send(("apply", update))
        super().apply(update)

    def drop_all(self) -> None:
        if self.group.broken is None:
            self.group.send(("drop",))
        super().drop_all()
