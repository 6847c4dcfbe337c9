"""EngineConfig: the engine's knobs, validated once at LLM construction.

This dataclass is the one definition of the engine settings: `LLM(**settings)` forwards to it and
the job file's `engine` section is derived from its fields (batchgen/job.py), so a new field added
here (with a default and a check) appears in both without further edits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Literal

from batchgen.engine.api.params import SettingError, is_int


@dataclass
class EngineConfig:
    # None in the next three: the device's default (device_defaults.resolve_engine_defaults):
    # 256 on CUDA where the paged varlen kernel then applies, else 16
    block_size: int | None = None
    max_num_seqs: int | None = None  # sequences in one step; None: 64 on CPU, 256 on CUDA
    max_num_batched_tokens: int | None = None  # tokens (prefill chunks + decodes) in one step; None: 2048 / 8192
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    # None: on CUDA what gpu_memory_utilization leaves after a profiling forward (memory.py), else
    # 1 GiB capped by what max_num_seqs can use (pool_sizing.num_kv_blocks_for)
    kv_cache_memory_bytes: int | None = None
    # CUDA: the share of the GPU's total memory this engine may use (weights, activations, KV pool)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # the attention backend (runner/backends): "auto" = "cpu" on the CPU (contiguous decode rows, the
    # native kernel where it applies), "triton" on CUDA where triton imports (its paged kernel over
    # the pool), else "torch" (portable torch ops over gathered blocks); "triton" on the CPU only
    # under Triton's interpreter (TRITON_INTERPRET=1, for tests)
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    # torch.compile of the model around the paged attention op (compiled_forward), and CUDA graphs
    # for decode on CUDA: "auto" = where it was measured to win (see resolve_compile: the CPU)
    compile: Literal["auto"] | bool = "auto"
    # ranks the model is split over (engine/parallel): heads, KV heads, MLP and LM head sharded, one
    # process per rank (NCCL on CUDA, gloo on the CPU); 1: no split, no extra process
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_kv_blocks",
            "kv_cache_memory_bytes",
            "max_model_len",
        ):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise SettingError("EngineConfig", name, "null or an integer >= 1", value)
        size = self.tensor_parallel_size
        if not is_int(size) or size < 1:
            raise SettingError("EngineConfig", "tensor_parallel_size", "an integer >= 1", size)
        share = self.gpu_memory_utilization
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
            raise SettingError("EngineConfig", "gpu_memory_utilization", "a number in (0, 1]", share)
        if not isinstance(self.enable_prefix_caching, bool):
            raise SettingError("EngineConfig", "enable_prefix_caching", "true or false", self.enable_prefix_caching)
        if not (self.compile == "auto" or isinstance(self.compile, bool)):
            raise SettingError("EngineConfig", "compile", "'auto', true or false", self.compile)
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise SettingError(
                "EngineConfig", "attention_backend", "'auto', 'torch', 'cpu' or 'triton'", self.attention_backend
            )


def engine_config(**settings: object) -> EngineConfig:
    """EngineConfig from keyword settings; an unknown name is a TypeError that lists the known ones."""
    known = [f.name for f in fields(EngineConfig)]
    unknown = [name for name in settings if name not in known]
    if unknown:
        raise TypeError(f"unknown engine setting(s) {unknown} (known: {', '.join(known)})")
    return EngineConfig(**settings)  # type: ignore[arg-type]


# The device names LLM and the job file accept (their availability is checked when the model loads).
DEVICE_NAME = re.compile(r"auto|cpu|mps|(cuda|xpu)(:\d+)?")
DEVICE_CHOICES = "auto, cpu, cuda, cuda:N, mps, xpu or xpu:N"
