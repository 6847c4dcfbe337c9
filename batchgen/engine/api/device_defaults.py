"""What None means for the engine settings whose best value depends on the device.

CPU keeps the values measured there (benchmarks/RESULTS.md): 16-token blocks, 64 sequences and
2,048 tokens a step. On CUDA:
- block_size 16 with the triton backend (its kernel reads small blocks in place; the default where
  triton imports), else 256 where that makes torch's paged varlen kernel apply (attention_path), else 16;
- max_num_seqs 256: a decode step reads all weights once whatever the batch, so decode throughput
  grows almost linearly with the batch until the sequences' K/V reads rival the weight reads;
  for a 1-8B model at ~1k-token contexts that is a few hundred sequences (vLLM's long-standing
  default is 256, nano-vllm's 512), and it lets the GPU check's 256-prompt workload run as one batch;
- max_num_batched_tokens 8192: a prefill chunk of a few thousand tokens already keeps a
  datacenter GPU's matrix units busy for a 1B+ model; beyond that a step only gets longer while
  the decodes in it wait (vLLM uses 8192-16384), and the profiling forward at this budget stays
  small next to the KV pool.
mps and xpu keep the CPU values: nothing has been measured there.
"""

from __future__ import annotations

import dataclasses

from batchgen.engine.api.config import EngineConfig

CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 2048
CUDA_MAX_NUM_SEQS = 256
CUDA_MAX_NUM_BATCHED_TOKENS = 8192


def resolve_engine_defaults(config: EngineConfig, device_type: str, block_size: int) -> EngineConfig:
    """A copy of `config` with every None among the device-dependent settings filled in.

    `block_size` is the device's default block size (attention_path.default_block_size).
    """
    cuda = device_type == "cuda"
    return dataclasses.replace(
        config,
        block_size=config.block_size if config.block_size is not None else block_size,
        max_num_seqs=config.max_num_seqs or (CUDA_MAX_NUM_SEQS if cuda else CPU_MAX_NUM_SEQS),
        max_num_batched_tokens=config.max_num_batched_tokens
        or (CUDA_MAX_NUM_BATCHED_TOKENS if cuda else CPU_MAX_NUM_BATCHED_TOKENS),
    )


def require_int(value: int | None, name: str) -> int:
    """A resolved setting; None here means resolve_engine_defaults was skipped (a bug, not user input)."""
    if value is None:
        raise ValueError(f"EngineConfig.{name} is None: resolve the device defaults (resolve_engine_defaults) first")
    return value
