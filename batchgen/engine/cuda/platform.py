"""CudaPlatform: a CUDA GPU's answers to the device questions (api/platform).

The attention backend `auto` means "triton" (its paged kernel over 16-token blocks, triton/) where
triton imports and the GPU is Ampere or newer, the only backend CUDA-graph decodes replay over
(graphs); "torch" elsewhere, with 256-token blocks where that makes torch's paged varlen kernel
apply (attention/path). compile `auto` is on, and with it decode steps replayed as CUDA graphs:
the launch overhead both remove is what bounds small decode batches here; a model that fails to
compile runs eager. Device memory is read through torch.cuda's counters (CudaMemory; no CPU test
runs it: benchmarks/gpu_check.py does, in its throughput section).

The step defaults:
- max_num_seqs 256: a decode step reads all weights once whatever the batch, so decode throughput
  grows almost linearly with the batch until the sequences' K/V reads rival the weight reads;
  for a 1-8B model at ~1k-token contexts that is a few hundred sequences (vLLM's long-standing
  default is 256, nano-vllm's 512), and it lets the GPU check's 256-prompt workload run as one batch;
- max_num_batched_tokens 8192: a prefill chunk of a few thousand tokens already keeps a
  datacenter GPU's matrix units busy for a 1B+ model; beyond that a step only gets longer while
  the decodes in it wait (vLLM uses 8192-16384), and the profiling forward at this budget stays
  small next to the KV pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchgen.engine.api.platform import GraphReplay, MemoryProbe, Platform
from batchgen.engine.cuda.graphs import GraphDecode
from batchgen.engine.triton import support as triton_support


class CudaPlatform(Platform):
    max_num_seqs = 256
    max_num_batched_tokens = 8192

    def default_dtype(self, model_path: str | None = None) -> torch.dtype:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def attention_backend(self, setting: str) -> str:
        if setting == "auto":
            return "triton" if triton_support.prefers_triton(self.device) else "torch"
        if setting == "triton":
            triton_support.check_device(self.device)
            return setting
        return super().attention_backend(setting)  # "torch"; "cpu" and unknown names refused

    def compiles_by_default(self) -> bool:
        return True

    def memory_probe(self) -> MemoryProbe | None:
        return CudaMemory(self.device)

    def decode_graphs(
        self, forward: Callable[..., torch.Tensor], max_rows: int, max_blocks: int, block_size: int
    ) -> GraphReplay | None:
        return GraphDecode(forward, max_rows, max_blocks, block_size, self.device)  # pragma: no cover - CUDA


class CudaMemory:  # pragma: no cover - needs CUDA
    """api/platform.MemoryProbe over torch.cuda's counters."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def clear(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))

    def used_and_total(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free), int(total)
