"""CudaMemory: memory.MemoryProbe over torch.cuda's counters. CUDA only: no CPU test runs this module
(benchmarks/gpu_check.py does, in its throughput section)."""

from __future__ import annotations

import torch


class CudaMemory:
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
