"""CudaPlatform: a CUDA GPU's answers to the device questions (api/platform).

Attention `auto`: "triton" where it imports on Ampere or newer (the only backend graphs replay
over), else "torch". compile `auto` is on, with CUDA-graph decodes (launch overhead bounds small
decode batches). Memory: torch.cuda's counters (run by benchmarks/gpu_check.py, no CPU test).
Step defaults: max_num_seqs 256 (decode throughput grows with the batch until K/V reads rival
weight reads; vLLM's default), max_num_batched_tokens 8192 (a few thousand tokens already fill a
GPU's matrix units; vLLM uses 8192-16384).
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
        self,
        forward: Callable[..., torch.Tensor],
        max_rows: int,
        max_blocks: int,
        block_size: int,
        rope_axes: int = 0,
    ) -> GraphReplay | None:
        return GraphDecode(forward, max_rows, max_blocks, block_size, self.device, rope_axes)  # pragma: no cover


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
