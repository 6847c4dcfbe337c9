"""How many KV blocks the engine gets: the one place LLM asks, whatever the device.

Explicit `num_kv_blocks` or `kv_cache_memory_bytes` win. Otherwise on CUDA the pool gets what
`gpu_memory_utilization` leaves after a profiling forward (memory.py); elsewhere today's CPU
default (model_runner.num_kv_blocks_for). `probe` is how the profile reads device memory: a
CudaMemory on a GPU, a fake in the CPU tests (which makes the CUDA branch testable on CPU).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from batchgen.engine.attention_path import VARLEN, choose_attention_path, detect_support, has_softcap
from batchgen.engine.config import EngineConfig
from batchgen.engine.device_defaults import require_int
from batchgen.engine.memory import MemoryProbe, MemoryProfile, pool_budget, profile_batch, profile_kv_budget
from batchgen.engine.model_runner import ModelRunner, kv_block_bytes, num_kv_blocks_for
from batchgen.engine.models import KVSpec


def _probe(device: torch.device) -> MemoryProbe:
    from batchgen.engine.cuda_memory import CudaMemory

    return CudaMemory(device)


def kv_pool_blocks(
    model: PreTrainedModel,
    spec: KVSpec,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    probe: MemoryProbe | None = None,
) -> tuple[int, MemoryProfile | None]:
    """(blocks, the memory profile when one was taken). `config` has its device defaults resolved."""
    block_size = require_int(config.block_size, "block_size")
    max_num_seqs = require_int(config.max_num_seqs, "max_num_seqs")
    max_model_len = require_int(config.max_model_len, "max_model_len")
    profiled = config.num_kv_blocks is None and config.kv_cache_memory_bytes is None
    if not (profiled and (device.type == "cuda" or probe is not None)):
        blocks = num_kv_blocks_for(
            spec,
            block_size,
            dtype,
            device,
            num_kv_blocks=config.num_kv_blocks,
            budget_bytes=config.kv_cache_memory_bytes,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        return blocks, None

    def make_runner(num_blocks: int) -> ModelRunner:
        # why gather: the profiling step's decodes need no per-sequence state
        return ModelRunner(model, spec, block_size, num_blocks, device, dtype, max_num_seqs, max_model_len, "gather")

    batch = profile_batch(
        require_int(config.max_num_batched_tokens, "max_num_batched_tokens"), max_num_seqs, max_model_len, block_size
    )
    vocab = int(model.get_input_embeddings().num_embeddings)  # type: ignore[arg-type]
    profile = profile_kv_budget(make_runner, batch, probe or _probe(device), vocab, config.gpu_memory_utilization)
    per_block = kv_block_bytes(spec, block_size, dtype)
    softcap = has_softcap(model.config)
    path = choose_attention_path(device.type, dtype, block_size, spec.head_dim, softcap, detect_support(device)).path
    budget = pool_budget(profile, spec.num_layers, path != VARLEN, per_block)
    return budget // per_block, profile
