"""EngineConfig: the engine's knobs as the user set them, validated once; ResolvedConfig: the same
with every default decided, before anything is built.

The one definition of the engine settings (`LLM(**settings)` and the job file's `engine` section
derive from it). api/platform's `resolve` leaves no None once the Platform and model config are
known; neither object changes after, and what is measured at load is kept beside them
(runner/pool_sizing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Literal

from batchgen.engine.api.params import SettingError, is_finite, is_int

# What a step may hold decoded (RGB, 3 bytes a pixel: ~96 MiB) by default: a few large photos.
DECODED_PIXELS = 32_000_000


@dataclass(frozen=True)
class EngineConfig:
    # None in the next three: the device's default (its Platform: api/platform.resolve):
    # 256 on CUDA where the paged varlen kernel then applies, else 16
    block_size: int | None = None
    max_num_seqs: int | None = None  # sequences in one step; None: 64 on CPU, 256 on CUDA
    max_num_batched_tokens: int | None = None  # tokens (prefill chunks + decodes) in one step; None: 2048 / 8192
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_bytes
    # None: on CUDA what gpu_memory_utilization leaves after a profiling forward (runner/pool_sizing), else
    # 1 GiB capped by what max_num_seqs can use (pool_sizing.kv_pool_blocks)
    kv_cache_memory_bytes: int | None = None
    # CUDA: the share of the GPU's total memory this engine may use (weights, activations, KV pool)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # the attention backend (the device's Platform): "auto" = "cpu" on the CPU (contiguous decode rows, the
    # native kernel where it applies), "triton" on CUDA where triton imports (its paged kernel over
    # the pool), else "torch" (portable torch ops over gathered blocks); "triton" on the CPU only
    # under Triton's interpreter (TRITON_INTERPRET=1, for tests)
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = "auto"
    # torch.compile of the model around the paged attention op (compiled_forward), and CUDA graphs
    # for decode on CUDA: "auto" = where it was measured to win (Platform.compiles_by_default)
    compile: Literal["auto"] | bool = "auto"
    # ranks the model is split over (engine/parallel): heads, KV heads, MLP and LM head sharded, one
    # process per rank (NCCL on CUDA, gloo on the CPU); 1: no split, no extra process
    tensor_parallel_size: int = 1
    # LoRA adapters per request (engine/lora): off unless enabled; None below: vLLM's defaults
    # (1 slot, rank 16, host copies of max_loras adapters); a job fills them from its adapters
    enable_lora: bool = field(default=False, metadata={"job": False, "job_note": "model.lora turns adapters on"})
    max_loras: int | None = None  # adapters resident on the device (slots); a step runs at most these
    max_lora_rank: int | None = None  # the largest adapter rank served (smaller ranks are zero-padded)
    max_cpu_loras: int | None = None  # adapters whose weights stay in host memory (>= max_loras)
    # vision-language models (engine/vision): the encoder cache's cap in image tokens (embeddings
    # kept while their images are prefilled); a step's chunks then touch at most this many image
    # tokens. None: max_num_batched_tokens, raised to the largest image, held outside a step's images.
    encoder_cache_tokens: int | None = None
    # vision-language models: decoded pixels (width x height) a step may hold before its images'
    # embeddings are computed; None: DECODED_PIXELS. One image is always allowed, whatever its size.
    max_decoded_pixels: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):  # every optional count: null or >= 1
            value = getattr(self, f.name)
            if f.type == "int | None" and value is not None and (not is_int(value) or value < 1):
                raise SettingError("EngineConfig", f.name, "null or an integer >= 1", value)
        size, share, loras = self.tensor_parallel_size, self.gpu_memory_utilization, self.max_loras or 1
        checks = [  # why one expression each: the whole list is built before the first is read
            ("tensor_parallel_size", is_int(size) and size >= 1, "an integer >= 1"),
            ("gpu_memory_utilization", is_finite(share) and 0 < share <= 1, "a number in (0, 1]"),
            *[(name, isinstance(getattr(self, name), bool), "true or false") for name in _SWITCHES],
            ("max_cpu_loras", (self.max_cpu_loras or loras) >= loras, f"null or >= max_loras ({loras})"),
            ("enable_lora", not (self.enable_lora is True and is_int(size) and size > 1), _LORA_TP),
            ("compile", self.compile == "auto" or isinstance(self.compile, bool), "'auto', true or false"),
            ("attention_backend", self.attention_backend in ATTENTION_BACKENDS, "'auto', 'torch', 'cpu' or 'triton'"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise SettingError("EngineConfig", name, expected, getattr(self, name))


_SWITCHES = ("enable_prefix_caching", "enable_lora")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
_LORA_TP = (
    "false with tensor_parallel_size > 1 (adapter slots are not sharded over ranks; "
    "run one engine per device with the shards or ray executors)"
)


@dataclass(frozen=True)
class ResolvedConfig(EngineConfig):
    """The settings the engine is built with: EngineConfig's, every default decided for one device,
    dtype and model (resolve). Only what resolve decides is declared again, narrowed."""

    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1
    compile: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 1
    max_decoded_pixels: int = DECODED_PIXELS
    compile_fallback: bool = False  # compile was "auto": a model that fails to compile runs eager


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
