"""Platform: the one object that answers every device-specific question, one class per device.

Why one object: asked of a Platform, the code above never tests a device's type; a new device is a
new class, not an `if` in ten places. This base class is the portable device (torch's own ops,
nothing measured or compiled); cpu/platform and cuda/platform subclass it (engine/platforms picks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, Protocol

import torch

from batchgen.engine.api.config import ATTENTION_BACKENDS, DECODED_PIXELS, EngineConfig, ResolvedConfig
from batchgen.engine.attention.path import (
    SMALL_BLOCK_SIZE,
    TRITON_CHOICE,
    AttentionChoice,
    choose_attention_path,
    default_block_size,
    detect_support,
)

GreedyIds = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None]  # logits [n, V] -> (ids, NaN flag)


class StepHook:
    """What runs before each step (the CPU's thread governor); `forget` after the process's own
    burst of work (a compile), so it is not read as busy neighbours. This one does nothing."""

    def tick(self) -> None:
        return None

    def forget(self) -> None:
        return None


class MemoryProbe(Protocol):
    """The device memory counters the KV pool's profiling forward reads (runner/pool_sizing)."""

    def clear(self) -> None:
        """Release cached, unused memory and reset the peak mark."""

    def allocated(self) -> int:
        """Bytes held by this process's tensors now."""

    def peak_allocated(self) -> int:
        """The most bytes held by this process's tensors since clear()."""

    def used_and_total(self) -> tuple[int, int]:
        """Bytes in use on the whole device (every process, the CUDA context), and its total."""


class GraphReplay(Protocol):
    """Decode-only steps replayed from graphs captured at start (cuda/graphs.GraphDecode)."""

    def fits(self, n: int, blocks: int) -> bool: ...

    def capture_all(self, run: Callable[..., torch.Tensor], make_context: Callable[..., object]) -> None: ...

    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        run: Callable[..., torch.Tensor],
        make_context: Callable[..., object],
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor | None: ...


class CompilePolicy:
    """What a device adds to a compiled forward (runner/compiled_forward); this one adds nothing."""

    def options(self) -> dict[str, Any]:
        """inductor's options for this device's forward."""
        return {}

    def drops_guard(self, entry: Any) -> bool:
        """Whether dynamo's guard `entry` may be dropped beyond the forward's own filter."""
        return False

    def matches(self) -> bool:
        """Whether the compiled forward may run now (False: this call runs eager)."""
        return True


class Platform:
    """The portable device's answers; the CPU and CUDA subclasses override what they measured."""

    max_num_seqs = 64  # the step defaults where nothing was measured: the CPU's (api/config)
    max_num_batched_tokens = 2048

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def attention_backend(self, setting: str) -> str:
        """The backend's name for `setting` here; a name that cannot run here is a ValueError."""
        check_backend_name(setting)
        home = {"cpu": "the CPU", "triton": "CUDA"}.get(setting)
        if home is not None:
            raise ValueError(f"attention_backend {setting!r} runs on {home}, not on {self.device.type}")
        return "torch"

    def block_size(self, backend: str, dtype: torch.dtype, head_dim: int, softcap: bool) -> int:
        """The default KV block size for the resolved `backend` and the model's attention: 16, but
        256 where that makes torch's paged varlen kernel apply (the triton kernel reads small blocks)."""
        if backend == "triton":
            return SMALL_BLOCK_SIZE
        return default_block_size(self.device.type, dtype, head_dim, softcap, detect_support(self.device))

    def attention_path(
        self, backend: str, dtype: torch.dtype, block_size: int, head_dim: int, softcap: bool
    ) -> AttentionChoice:
        """How the resolved `backend` attends here (attention/path), with the reason."""
        if backend == "triton":
            return TRITON_CHOICE
        support = detect_support(self.device)
        return choose_attention_path(self.device.type, dtype, block_size, head_dim, softcap, support)

    def compiles_by_default(self) -> bool:
        """What engine.compile `auto` means here: only where compiling was measured to win."""
        return False

    def compile_policy(self) -> CompilePolicy:
        """What a compiled forward is told here."""
        return CompilePolicy()

    def prepare_process(self) -> None:
        """Once per engine, before the model loads."""

    def install_kernels(self, model: torch.nn.Module, dtype: torch.dtype) -> int:
        """Route the model's layers through this device's measured kernels; how many were."""
        return 0

    def greedy_ids(self) -> GreedyIds | None:
        """The device's own greedy pass for the sampler, where it has one."""
        return None

    def step_hook(self) -> StepHook:
        """A new hook for one runner's steps (the thread policy)."""
        return StepHook()

    def memory_probe(self) -> MemoryProbe | None:
        """How the KV pool's profiling forward reads device memory; None: not profiled here."""
        return None

    def decode_graphs(
        self, forward: Callable[..., torch.Tensor], max_rows: int, max_blocks: int, block_size: int, rope_axes: int = 0
    ) -> GraphReplay | None:
        """Decode steps replayed from graphs (not yet captured); None where the device has none.
        `rope_axes` (3: M-RoPE): the forward's positions are [axes, B], staged beside the KV positions."""
        return None

    def facts(self, build: bool = False) -> dict[str, Any]:
        """What `batchgen doctor` reports of this device (with `build`: its kernels built first)."""
        return {}

    def pending_kernels(self) -> tuple[list[str], str]:
        """The kernels a first engine here would build before its first step, and how long that takes."""
        return [], ""

    def forget_measured(self) -> int:
        """Forget the kernel choices measured on this machine (`batchgen doctor --remeasure`); how many went."""
        return 0


def check_backend_name(setting: str) -> None:
    if setting not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {setting!r}")


def resolve(
    config: EngineConfig,
    platform: Platform,
    *,
    max_model_len: int,
    dtype: torch.dtype,
    head_dim: int,
    softcap: bool,
    compiles: bool = True,
) -> ResolvedConfig:
    """`config` on `platform` for a model of `max_model_len` (resolved from its config), `head_dim`
    and soft-capping. `compiles`: False where compiling serves nothing (pooling forwards run eager);
    tensor-parallel ranks run eager too (README, tensor parallelism). num_kv_blocks None is sized
    at load (runner/pool_sizing); encoder_cache_tokens None is sized by the scheduler (core/image_budget)."""
    backend = platform.attention_backend(config.attention_backend)
    compile = compiles and (platform.compiles_by_default() if config.compile == "auto" else config.compile)
    settings: dict[str, Any] = {f.name: getattr(config, f.name) for f in fields(EngineConfig)}
    return ResolvedConfig(
        **{
            **settings,
            "block_size": config.block_size or platform.block_size(backend, dtype, head_dim, softcap),
            "max_num_seqs": config.max_num_seqs or platform.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens or platform.max_num_batched_tokens,
            "max_model_len": max_model_len,
            "attention_backend": backend,
            "compile": compile and config.tensor_parallel_size == 1,
            "compile_fallback": config.compile == "auto",
            "max_loras": config.max_loras or 1,
            "max_lora_rank": config.max_lora_rank or 16,
            "max_cpu_loras": config.max_cpu_loras or config.max_loras or 1,
            "max_decoded_pixels": config.max_decoded_pixels or DECODED_PIXELS,
        }
    )
