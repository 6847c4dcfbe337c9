"""How many KV blocks the engine gets: the one place LLM asks, whatever the device.

Explicit `num_kv_blocks` or `kv_cache_memory_bytes` win, then a budget measured at load (TP rank 0),
then a profiling forward where the Platform has a memory probe (CUDA), else the CPU default. What
was measured is returned beside the config, never written into it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.api.platform import MemoryProbe
from batchgen.engine.attention.path import SDPA, has_softcap
from batchgen.engine.platforms import platform_for
from batchgen.engine.runner.memory import MemoryProfile, pool_budget, profile_batch, profile_kv_budget
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.runner.models import KVSpec

CPU_CAPACITY_FACTOR = 2  # CPU pool: at most 2x what max_num_seqs full-length sequences need


def kv_block_bytes(spec: KVSpec, block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block, every layer."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


def num_kv_blocks_for(spec: KVSpec, config: ResolvedConfig, dtype: torch.dtype, budget_bytes: int | None) -> int:
    """Pool size: explicit blocks, else a byte budget (on CUDA, by default, memory.py's), else a CPU default."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = kv_block_bytes(spec, config.block_size, dtype)
    if budget_bytes is None:
        # why: on CPU a default 1 GiB of zeros would be touched for nothing beyond this many blocks
        cap = CPU_CAPACITY_FACTOR * config.max_num_seqs * math.ceil(config.max_model_len / config.block_size)
        return max(1, min((1 << 30) // bytes_per_block, cap))
    blocks = budget_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is below one block ({bytes_per_block} bytes)")
    return blocks


def kv_pool_blocks(
    model: PreTrainedModel,
    spec: KVSpec,
    config: ResolvedConfig,
    device: torch.device,
    dtype: torch.dtype,
    probe: MemoryProbe | None = None,
    measured_budget: int | None = None,
) -> tuple[int, MemoryProfile | None]:
    """(blocks, the memory profile when one was taken). `measured_budget`: bytes measured at load
    (tensor parallelism's rank 0), used where the settings give no size."""
    budget = config.kv_cache_memory_bytes if config.kv_cache_memory_bytes is not None else measured_budget
    if config.num_kv_blocks is None and budget is None:
        probe = probe or platform_for(device).memory_probe()
    if config.num_kv_blocks is not None or budget is not None or probe is None:
        return num_kv_blocks_for(spec, config, dtype, budget), None

    # why torch for the others: the profiling step's decodes need no per-sequence state (triton keeps none)
    profiled_backend = "triton" if config.attention_backend == "triton" else "torch"

    def make_runner(num_blocks: int) -> ModelRunner:
        # why graphs, eager: the runner's CUDA graphs (triton only) are measured with it; compiling
        # here would compile the forward twice
        profiled = replace(config, attention_backend=profiled_backend, compile=False)
        return ModelRunner(model, spec, profiled, num_blocks, device, dtype, cuda_graphs=config.compile)

    block_size = config.block_size
    batch = profile_batch(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len, block_size)
    vocab = int(model.get_input_embeddings().num_embeddings)  # type: ignore[arg-type]
    profile = profile_kv_budget(make_runner, batch, probe, vocab, config.gpu_memory_utilization)
    per_block = kv_block_bytes(spec, block_size, dtype)
    path = platform_for(device).attention_path(
        profiled_backend, dtype, block_size, spec.head_dim, has_softcap(model.config)
    )
    gathers = path.path == SDPA  # why: the triton kernel and torch's varlen one read the pool in place
    budget = pool_budget(profile, spec.num_layers, gathers, per_block)
    return budget // per_block, profile
