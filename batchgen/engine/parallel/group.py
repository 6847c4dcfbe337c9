"""The tensor-parallel group as rank 0 sees it: the worker processes, the pipes that carry each step
to the workers, and a shutdown that leaves no process behind (the collectives: parallel/loading).

Ranks 1..N-1 are fresh interpreters (`python -m batchgen.engine.parallel.worker`: safe with
threads and CUDA, never re-importing the user's script). Steps go over one pipe per worker
(sending never waits; a worker sees EOF when rank 0 dies). A dead rank is named before each
message; a step that failed part-way shuts the group down.

Rank 0's runner is a ShardedRunner: the single-device ModelRunner over its shard, unseen by the
engine, that sends every call moving runner state to the workers first: the construction
arguments (no sampler), each step's frozen batch (a few KB), the diffs between steps, and
drop-all; rank 0 alone draws from the gathered logits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.core.runner_output import ModelRunnerOutput
from batchgen.engine.core.scheduler_output import BatchUpdate, ScheduledBatch
from batchgen.engine.parallel.loading import CollectiveError, Collectives, load_sharded_model
from batchgen.engine.parallel.plan import shard_plan
from batchgen.engine.platforms import platform_for
from batchgen.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Seconds a collective may wait for the other ranks. Why so long by default: a prefill step of a
# large model on a busy CPU is slow on every rank alike; a dead rank is caught sooner (a closed
# socket, or the liveness check before each step). BATCHGEN_TP_TIMEOUT_S overrides it.
DEFAULT_TIMEOUT_S = 600.0
JOIN_S = 10.0  # how long a stopped worker may take to exit before it is terminated
FAIL_WAIT_S = 2.0  # a failed group: how long a terminated worker may take before it is killed
DEATH_WAIT_S = 3.0  # after a failed collective: how long to look for the rank that caused it


class TensorParallelError(RuntimeError):
    """A rank died, a collective failed or timed out, or the group was shut down."""


def worker_device(device: torch.device, rank: int) -> str:
    """Rank `rank`'s device: the next GPU after rank 0's on CUDA, the CPU otherwise."""
    if device.type != "cuda":
        return device.type
    base = device.index if device.index is not None else torch.cuda.current_device()
    if base + rank >= torch.cuda.device_count():
        raise TensorParallelError(
            f"tensor parallel rank {rank} needs cuda:{base + rank}; this machine has {torch.cuda.device_count()} GPUs"
        )
    return f"cuda:{base + rank}"


class TensorParallelGroup:
    def __init__(self, path: str, world: int, device: torch.device, dtype: torch.dtype) -> None:
        timeout_s = float(os.environ.get("BATCHGEN_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self.world = world
        self.folder = tempfile.mkdtemp(prefix="batchgen-tp-")
        store = os.path.join(self.folder, "store")
        devices = [worker_device(device, rank) for rank in range(1, world)]
        self.processes: list[subprocess.Popen[bytes]] = []
        self.pipes: list[Connection] = []
        self.broken: str | None = None  # why the group can no longer be used
        self.kv_budget: int | None = None  # KV pool bytes measured on rank 0 after loading (start_tensor_parallel)
        self._finalizer = weakref.finalize(self, _shutdown, self.processes, self.pipes, self.folder)
        for rank, rank_device in enumerate(devices, start=1):
            self._start(rank, rank_device, store, path, dtype, timeout_s)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            self._wait_ready()
            comm = Collectives(store, 0, world, device, timeout_s)
            self.model = load_sharded_model(path, comm, 0, device, dtype)
        except BaseException as exc:
            self.close()
            raise TensorParallelError(f"tensor parallel start ({world} ranks) failed: {self.dead() or exc}") from exc
        logger.info("tensor parallel group: %d ranks, workers %s", world, [p.pid for p in self.processes])

    def _start(self, rank: int, device: str, store: str, path: str, dtype: torch.dtype, timeout_s: float) -> None:
        """Worker `rank`: a fresh interpreter (nothing of this process's state, threads or CUDA context
        inherited; the user's main module is not re-imported), its pipe end inherited as a descriptor."""
        ours, theirs = mp.Pipe()
        args = dict(rank=rank, world=self.world, store=store, fd=theirs.fileno(), path=path, device=device)
        args.update(dtype=str(dtype).removeprefix("torch."), timeout_s=timeout_s)
        command = [sys.executable, "-m", "batchgen.engine.parallel.worker", json.dumps(args)]
        process = subprocess.Popen(command, pass_fds=[theirs.fileno()])
        theirs.close()
        self.processes.append(process)
        self.pipes.append(ours)

    def _wait_ready(self) -> None:
        """Every worker imported and about to join the rendezvous, or the first that died, named."""
        for rank, pipe in enumerate(self.pipes, start=1):
            while not pipe.poll(0.2):
                found = self.dead()
                if found is not None:
                    raise TensorParallelError(found)
            try:
                pipe.recv()
            except (EOFError, OSError):
                raise TensorParallelError(self.dead() or f"tensor parallel rank {rank} closed its pipe") from None

    def dead(self, wait_s: float = 0.0) -> str | None:
        """A description of the first worker that is no longer running, or None; `wait_s`: how long
        to keep looking (after a failed collective, the dead rank's exit may not be reaped yet)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                code = process.poll()
                if code is not None:
                    return f"tensor parallel rank {rank} (pid {process.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def check(self) -> None:
        """Raise if the group cannot run a step: shut down, out of step, or a worker gone."""
        if self.broken is None:
            found = self.dead()
            if found is not None:
                self.fail(found)
        if self.broken is not None:
            raise TensorParallelError(self.broken)

    def send(self, message: tuple[object, ...]) -> None:
        """`message` to every worker (checked alive first)."""
        self.check()
        try:
            for pipe in self.pipes:
                pipe.send(message)
        except OSError as exc:  # a worker died between the check and the send
            self.fail(f"{self.dead() or 'a tensor parallel worker'} ({exc})")
            raise TensorParallelError(self.broken or str(exc)) from exc

    def fail(self, why: str) -> None:
        """Mark the group unusable and stop its workers (the others would otherwise wait in a collective)."""
        if self.broken is None:
            self.broken = f"{why}; the tensor-parallel engine is shut down (make a new LLM to continue)"
            logger.error("%s", self.broken)
        for process in self.processes:  # why not a stop message: a failed rank may never read it
            process.terminate()
        for process in self.processes:
            try:
                process.wait(FAIL_WAIT_S)
            except subprocess.TimeoutExpired:  # stopped or stuck: SIGTERM is not acted on
                process.kill()
        self.close()

    def close(self) -> None:
        """Stop every worker and release the process group; idempotent."""
        if self.broken is None:
            self.broken = "the tensor-parallel group was closed"
        self._finalizer()


def start_tensor_parallel(
    path: str, config: ResolvedConfig, device: torch.device, dtype: torch.dtype
) -> TensorParallelGroup | None:
    """The group for `config.tensor_parallel_size` > 1 (None for 1), its rank 0 shard loaded.

    On CUDA with no pool size set, the KV budget is measured from rank 0's memory after loading
    (`kv_budget`): the profiling forward cannot run on rank 0 alone."""
    if config.tensor_parallel_size == 1:
        return None
    # why here (LLM checked the model already): refuse a model that cannot be split before any process starts
    shard_plan(AutoConfig.from_pretrained(path), 0, config.tensor_parallel_size)
    group = TensorParallelGroup(path, config.tensor_parallel_size, device, dtype)
    probe = platform_for(device).memory_probe()
    if probe is not None and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
        _, total = probe.used_and_total()
        reserve = max(1 << 30, total // 20)  # activations of a step and the gathered logits, roughly
        group.kv_budget = int(total * config.gpu_memory_utilization) - probe.allocated() - reserve
        if group.kv_budget <= 0:
            group.close()
            raise TensorParallelError(f"no GPU memory left for the KV cache on {device} after loading the shard")
    return group


class ShardedRunner(ModelRunner):
    def __init__(self, group: TensorParallelGroup, model: PreTrainedModel, *args: Any, **kwargs: Any) -> None:
        """`args`, `kwargs`: ModelRunner's after the model (spec, config, num_kv_blocks, device, dtype, ...)."""
        self.group = group
        group.send(("build", args, {k: v for k, v in kwargs.items() if k != "sampler"}))
        super().__init__(model, *args, **kwargs)

    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        try:
            self.group.send(("execute", batch))  # checks the group first
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
            self.group.send(("drop_all",))
        super().drop_all()


def _shutdown(processes: list[subprocess.Popen[bytes]], pipes: list[Connection], folder: str) -> None:
    """Stop, wait, terminate, kill: no worker outlives this call."""
    for pipe in pipes:
        with contextlib.suppress(OSError):  # that worker is gone already
            pipe.send(("stop",))
        pipe.close()
    for process in processes:
        for stop in (None, process.terminate, process.kill):
            if stop is not None:
                stop()
            try:
                process.wait(JOIN_S)
                break
            except subprocess.TimeoutExpired:
                continue
    shutil.rmtree(folder, ignore_errors=True)
