"""ShardedRunner: rank 0's model runner, which sends every call that moves runner state to the workers.

Why a subclass of ModelRunner: rank 0 runs exactly the single-device code over its shard, and
the engine cannot tell the difference. What must reach the workers, in the order rank 0 sees it:
the construction arguments (built once), each step's batch (sent from the before-upload hook,
after the engine's own hook, with the scheduler diffs that hook applied, so a worker applies them
at the same point of its step), diffs applied between steps, and drop-all. The step message is
the scheduler's frozen batch itself (token ids, block tables, diffs): a few KB pickled, sent
without waiting. A step that fails part-way shuts the group down (the ranks are out of step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from batchgen.engine.core.scheduler import BatchUpdate, ScheduledBatch
from batchgen.engine.parallel.collectives import CollectiveError
from batchgen.engine.parallel.group import DEATH_WAIT_S, TensorParallelError, TensorParallelGroup
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.runner.models import KVSpec


class ShardedRunner(ModelRunner):
    def __init__(
        self,
        group: TensorParallelGroup,
        model: PreTrainedModel,
        spec: KVSpec,
        block_size: int,
        num_kv_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        *rest: Any,
        **kwargs: Any,
    ) -> None:
        self.group = group
        self._engine_hook: Callable[[ScheduledBatch], None] | None = None
        self._captured: list[BatchUpdate] | None = None  # diffs the engine's hook applies mid-step
        self._in_step = False
        kwargs = {**kwargs, "compile": False}  # why: see README, tensor parallelism
        group.send(("build", spec, block_size, num_kv_blocks, dtype, rest, kwargs))
        super().__init__(model, spec, block_size, num_kv_blocks, device, dtype, *rest, **kwargs)

    @property
    def before_upload(self) -> Callable[[ScheduledBatch], None]:
        return self._send_step

    @before_upload.setter
    def before_upload(self, hook: Callable[[ScheduledBatch], None] | None) -> None:
        self._engine_hook = hook

    def _send_step(self, batch: ScheduledBatch) -> None:
        self._captured = []
        try:
            if self._engine_hook is not None:
                self._engine_hook(batch)
            updates = tuple(self._captured)
        finally:
            self._captured = None
        self.group.send(("execute", batch, updates))

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        self.group.check()
        self._in_step = True
        try:
            return super().execute(batch)
        except BaseException as exc:
            wait = DEATH_WAIT_S if isinstance(exc, CollectiveError) else 0.0
            why = self.group.dead(wait) or f"rank 0 failed in a step ({type(exc).__name__}: {exc})"
            self.group.fail(why)
            if isinstance(exc, Exception) and not isinstance(exc, TensorParallelError):
                raise TensorParallelError(why) from exc
            raise
        finally:
            self._in_step = False

    def apply(self, update: BatchUpdate) -> None:
        if update:
            if self._captured is not None:
                self._captured.append(update)
            elif not self._in_step:  # why: inside a step the worker applies batch.update itself
                self.group.send(("apply", update))
        super().apply(update)

    def drop_all(self) -> None:
        if self.group.broken is None:
            self.group.send(("drop",))
        super().drop_all()

    def close(self) -> None:
        self.group.close()
