"""How many KV blocks the engine gets: the one place LLM asks, whatever the device.

Explicit `num_kv_blocks` or `kv_cache_memory_bytes` win, then a budget measured at load (TP rank 0),
then a profiling forward where the Platform has a memory probe (CUDA), else the CPU default. What
was measured is returned beside the config, never written into it. On CUDA the pool gets what
`gpu_memory_utilization` leaves after the profiling forward:

    budget = utilization * total - in use now - the runner's own - activation peak - sampler headroom
    (gather + SDPA path only: less the share a decode step's gathered K/V copy can take)

The runner's own share includes its CUDA graphs' pool. The profiling step is the worst one the
scheduler can produce, over a two-block scratch pool (shapes, not values, set the peak). The
device is read through a MemoryProbe (a fake in the CPU tests).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from transformers import PreTrainedModel

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.api.platform import MemoryProbe
from batchgen.engine.attention.path import SDPA, has_softcap
from batchgen.engine.core.scheduler_output import ScheduledBatch, ScheduledChunk
from batchgen.engine.platforms import platform_for
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.runner.models import KVSpec

logger = logging.getLogger(__name__)

CPU_CAPACITY_FACTOR = 2  # CPU pool: at most 2x what max_num_seqs full-length sequences need
PROFILE_BLOCKS = 2  # the scratch pool of the profiling forward
SAMPLER_COPIES = 4  # float32 [rows, vocab] tensors the sampler may hold at once (logits, probs, sorted, mask)
GATHER_LAYERS_HEADROOM = 2  # gather path: a decode step's K+V copy of one layer, padded: <= 2 / num_layers of the pool


@dataclass(frozen=True)
class MemoryProfile:
    """What the profiling forward measured and what the pool got (logged; the GPU check records it)."""

    total: int
    used_before_pool: int  # in use on the device after profiling (weights, context, other processes)
    activation_peak: int  # the profiling forward's peak above what stays allocated
    sampler_headroom: int
    utilization: float
    kv_budget: int  # bytes for the KV pool
    runner_memory: int = 0  # what a runner keeps on the device while it lives: its CUDA graphs' pool, buffers


def profile_batch(max_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> ScheduledBatch:
    """The worst step: one long chunk ending at max_model_len plus single-token decodes, every one sampled."""
    rows = max(1, min(max_num_seqs, max_batched_tokens))
    n_long = min(max_batched_tokens - (rows - 1), max_model_len)
    context = max_model_len - n_long
    blocks = math.ceil((context + n_long) / block_size)
    long = ScheduledChunk(0, context, (0,) * n_long, (0,) * blocks, True, False)
    return ScheduledBatch((long, *(ScheduledChunk(i, 1, (0,), (1,), True, True) for i in range(1, rows))))


def profile_kv_budget(
    make_runner: Callable[[int], ModelRunner],
    batch: ScheduledBatch,
    probe: MemoryProbe,
    vocab_size: int,
    utilization: float,
) -> MemoryProfile:
    """Run `batch` once on a runner with a PROFILE_BLOCKS pool; the bytes the real pool may take."""
    probe.clear()
    before = probe.allocated()
    runner = make_runner(PROFILE_BLOCKS)
    resting = probe.allocated()  # weights + scratch pool
    try:
        logits = runner.execute(batch)
    except torch.OutOfMemoryError as exc:
        long = batch.chunks[0]
        raise ValueError(
            f"the profiling forward ran out of device memory: the worst step these settings allow ({long.num_tokens} "
            f"tokens after {long.start} tokens of context, {len(batch.chunks)} sequences) does not fit; lower "
            "max_num_batched_tokens or max_model_len"
        ) from exc
    peak = probe.peak_allocated()
    del logits
    probe.clear()
    with_runner, _ = probe.used_and_total()
    del runner
    probe.clear()
    used, total = probe.used_and_total()
    # why: what the runner itself keeps on the device while it lives (its CUDA graphs' memory pool,
    # captured when it was made: cuda/graphs; buffers; the scratch pool), which the real runner keeps too
    runner_bytes = max(0, with_runner - used)
    rows = sum(c.needs_sample for c in batch.chunks)
    headroom = SAMPLER_COPIES * rows * vocab_size * 4
    activation_peak = max(0, peak - resting)
    budget = int(total * utilization) - used - runner_bytes - activation_peak - headroom  # <= 0: no pool
    logger.info(
        "memory profile: total %.2f GiB, in use %.2f GiB (before the scratch pool %.2f GiB), the runner's own "
        "(CUDA graphs, buffers) %.2f GiB, activation peak %.2f GiB, sampler headroom %.2f GiB, utilization %.2f "
        "-> KV budget %.2f GiB",
        *(x / 2**30 for x in (total, used, before, runner_bytes, activation_peak, headroom)),
        utilization,
        budget / 2**30,
    )
    return MemoryProfile(total, used, activation_peak, headroom, utilization, budget, runner_bytes)


def pool_budget(profile: MemoryProfile, num_layers: int, gather: bool, bytes_per_block: int) -> int:
    """The pool's bytes from a profile; a clear error when not even one block fits."""
    budget = profile.kv_budget
    if gather:  # why: the decode gather copies up to a layer's share of the pool, on top of it
        budget = budget * num_layers // (num_layers + GATHER_LAYERS_HEADROOM)
    if budget < bytes_per_block:
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization={profile.utilization} leaves no room for the KV cache: "
            f"{profile.utilization} x {profile.total / gib:.2f} GiB total, {profile.used_before_pool / gib:.2f} GiB "
            f"in use (weights, CUDA context, other processes), {profile.activation_peak / gib:.2f} GiB activation "
            f"peak at max_num_batched_tokens; raise gpu_memory_utilization or lower max_num_batched_tokens, "
            "max_num_seqs or max_model_len"
        )
    return budget


def kv_block_bytes(spec: KVSpec, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block, every layer."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def kv_pool_blocks(
    model: PreTrainedModel,
    spec: KVSpec,
    config: ResolvedConfig,
    device: torch.device,
    dtype: torch.dtype,
    probe: MemoryProbe | None = None,
    measured_budget: int | None = None,
) -> tuple[int, MemoryProfile | None]:
    """(blocks, the memory profile when one was taken): explicit blocks, else a byte budget (set, or
    `measured_budget`: bytes measured at load by tensor parallelism's rank 0, or the profiled one
    where the device has a memory probe: CUDA), else a CPU default."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, None
    block_size, per_block = config.block_size, kv_block_bytes(spec, config.block_size, dtype)
    budget = config.kv_cache_memory_bytes if config.kv_cache_memory_bytes is not None else measured_budget
    if budget is not None:
        if budget < per_block:
            raise ValueError(f"KV cache budget of {budget} bytes is below one block ({per_block} bytes)")
        return budget // per_block, None
    probe = probe or platform_for(device).memory_probe()
    if probe is None:
        # why: on CPU a default 1 GiB of zeros would be touched for nothing beyond this many blocks
        cap = CPU_CAPACITY_FACTOR * config.max_num_seqs * math.ceil(config.max_model_len / block_size)
        return max(1, min((1 << 30) // per_block, cap)), None

    # why torch for the others: the profiling step's decodes need no per-sequence state (triton keeps none)
    profiled_backend: Literal["triton", "torch"] = "triton" if config.attention_backend == "triton" else "torch"

    def make_runner(num_blocks: int) -> ModelRunner:
        # why graphs, eager: the runner's CUDA graphs (triton only) are measured with it; compiling
        # here would compile the forward twice
        profiled = replace(config, attention_backend=profiled_backend, compile=False)
        return ModelRunner(model, spec, profiled, num_blocks, device, dtype, cuda_graphs=config.compile)

    batch = profile_batch(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len, block_size)
    vocab = int(model.get_input_embeddings().num_embeddings)  # type: ignore[arg-type]
    profile = profile_kv_budget(make_runner, batch, probe, vocab, config.gpu_memory_utilization)
    path = platform_for(device).attention_path(
        profiled_backend, dtype, block_size, spec.head_dim, has_softcap(model.config)
    )
    gathers = path.path == SDPA  # why: the triton kernel and torch's varlen one read the pool in place
    budget = pool_budget(profile, spec.num_layers, gathers, per_block)
    return budget // per_block, profile
