"""KV pool sizing after a profiling forward (pool_sizing.py) and the device-aware defaults
(api/config.resolve over each device's Platform),
on CPU: device memory is read through a fake probe, the profiling forward is real."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.config import EngineConfig, ResolvedConfig
from batchgen.engine.api.platform import Platform, resolve
from batchgen.engine.cuda.platform import CudaPlatform
from batchgen.engine.platforms import platform_for
from batchgen.engine.runner import models
from batchgen.engine.runner.pool_sizing import (
    GATHER_LAYERS_HEADROOM,
    SAMPLER_COPIES,
    MemoryProfile,
    kv_block_bytes,
    kv_pool_blocks,
    pool_budget,
    profile_batch,
)

GIB = 1 << 30
CUDA = CudaPlatform(torch.device("cuda"))  # its answers, asked on a machine without a GPU


def resolved(config: EngineConfig, platform: Platform) -> ResolvedConfig:
    """`config` resolved for a float32 model of head dim 16 (the tiny llama's) and 512 positions."""
    max_len = config.max_model_len or 512
    return resolve(config, platform, max_model_len=max_len, dtype=torch.float32, head_dim=16, softcap=False)


class FakeProbe:
    """allocated(): before the scratch runner, then after it; peak and device totals fixed."""

    def __init__(self, allocated: list[int], peak: int, used: int | list[int], total: int) -> None:
        """`used`: what the device has in use at each read (the last one repeats)."""
        self._allocated, self._peak, self._total = list(allocated), peak, total
        self._used = list(used) if isinstance(used, list) else [used]
        self.clears = 0

    def clear(self) -> None:
        self.clears += 1

    def allocated(self) -> int:
        return self._allocated.pop(0)

    def peak_allocated(self) -> int:
        return self._peak

    def used_and_total(self) -> tuple[int, int]:
        return (self._used.pop(0) if len(self._used) > 1 else self._used[0]), self._total


def test_device_defaults() -> None:
    cpu = resolved(EngineConfig(), platform_for("cpu"))
    assert (cpu.block_size, cpu.max_num_seqs, cpu.max_num_batched_tokens) == (16, 64, 2048)
    mps = resolved(EngineConfig(), platform_for("mps"))  # nothing measured there: the CPU's values
    assert (mps.block_size, mps.max_num_seqs, mps.max_num_batched_tokens, mps.attention_backend) == (
        16,
        64,
        2048,
        "torch",
    )
    cuda = resolved(EngineConfig(block_size=256), CUDA)
    assert (cuda.block_size, cuda.max_num_seqs, cuda.max_num_batched_tokens) == (256, 256, 8192)
    mine = resolved(EngineConfig(block_size=32, max_num_seqs=3, max_num_batched_tokens=99), CUDA)
    assert (mine.block_size, mine.max_num_seqs, mine.max_num_batched_tokens) == (32, 3, 99)


def test_the_configs_are_frozen_and_what_load_measures_stays_beside_them(tiny_model: Callable[[str], Path]) -> None:
    """The user's settings and the resolved ones never change after they are made; a budget
    measured at load (a tensor-parallel rank 0's free memory) sizes the pool without being
    written into either."""
    llm = LLM(str(tiny_model("llama")), device="cpu", num_kv_blocks=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        llm.config.compile = True  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().max_model_len = 8  # type: ignore[misc]
    model, spec = llm.engine.runner.model, models.kv_spec(llm.engine.runner.model.config)
    config = resolved(EngineConfig(max_model_len=256), platform_for("cpu"))
    blocks, profile = kv_pool_blocks(model, spec, config, torch.device("cpu"), torch.float32, measured_budget=1 << 20)
    assert (blocks, profile) == ((1 << 20) // 8192, None) and config.kv_cache_memory_bytes is None


def test_cpu_keeps_todays_defaults_and_sizing(tiny_model: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model("llama")), device="cpu")
    config = llm.config
    assert (config.block_size, config.max_num_seqs, config.max_num_batched_tokens) == (16, 64, 2048)
    assert llm.memory_profile is None
    # today's CPU pool: at most 2x what 64 full-length (512-token) sequences need
    assert llm.engine.runner.num_kv_blocks == 2 * 64 * 512 // 16


def test_profile_batch_is_the_worst_step() -> None:
    batch = profile_batch(max_batched_tokens=100, max_num_seqs=8, max_model_len=300, block_size=16)
    long, decodes = batch.chunks[0], batch.chunks[1:]
    assert sum(c.num_tokens for c in batch.chunks) == 100 and sum(c.needs_sample for c in batch.chunks) == 8
    assert long.start + long.num_tokens == 300 and not long.is_decode and len(long.block_table) == 19
    assert all(c.is_decode and c.num_tokens == 1 for c in decodes) and len(decodes) == 7
    short = profile_batch(max_batched_tokens=4096, max_num_seqs=2, max_model_len=256, block_size=16)
    assert short.chunks[0].start == 0 and short.chunks[0].num_tokens == 256  # capped by the context


def test_the_gather_headroom_and_the_error_when_nothing_fits() -> None:
    profile = MemoryProfile(80 * GIB, 70 * GIB, 2 * GIB, 0, 0.9, 0)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 leaves no room for the KV cache.*70.00 GiB"):
        pool_budget(profile, num_layers=16, gather=False, bytes_per_block=1024)
    roomy = MemoryProfile(80 * GIB, 10 * GIB, GIB, 0, 0.9, 18 * GIB)
    assert pool_budget(roomy, 16, False, 1024) == 18 * GIB
    assert pool_budget(roomy, 16, True, 1024) == 18 * GIB * 16 // (16 + GATHER_LAYERS_HEADROOM)


def test_pool_is_sized_after_a_real_profiling_forward(tiny_model: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model("llama")), device="cpu", num_kv_blocks=4)
    model, spec = llm.engine.runner.model, models.kv_spec(llm.engine.runner.model.config)
    config = resolved(EngineConfig(max_model_len=256, gpu_memory_utilization=0.5), platform_for("cpu"))
    probe = FakeProbe(allocated=[1000, 1200], peak=1700, used=2 * GIB, total=8 * GIB)
    blocks, profile = kv_pool_blocks(model, spec, config, torch.device("cpu"), torch.float32, probe=probe)
    assert profile is not None and probe.clears == 3 and profile.runner_memory == 0
    headroom = SAMPLER_COPIES * 64 * 256 * 4  # 64 sampled rows, vocab 256, float32
    assert (profile.activation_peak, profile.sampler_headroom) == (500, headroom)
    assert profile.kv_budget == 4 * GIB - 2 * GIB - 500 - headroom
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V x 2 layers x 16 tokens x 2 KV heads x head dim 16 x float32
    assert kv_block_bytes(spec, 16, torch.float32) == per_block == 8192
    assert blocks == profile.kv_budget * 2 // (2 + GATHER_LAYERS_HEADROOM) // per_block  # 2 layers, gather path


def test_what_the_profiling_runner_keeps_while_it_lives_is_outside_the_budget(
    tiny_model: Callable[[str], Path],
) -> None:
    """The device's use is read with the profiling runner alive (on CUDA with the triton backend its
    decode graphs, captured when it was made, hold a memory pool) and after it is gone: the
    difference is kept out of the KV budget, as the real runner will hold the same."""
    llm = LLM(str(tiny_model("llama")), device="cpu", num_kv_blocks=4)
    model, spec = llm.engine.runner.model, models.kv_spec(llm.engine.runner.model.config)
    config = resolved(EngineConfig(max_model_len=256, gpu_memory_utilization=0.5), platform_for("cpu"))
    graphs = 300 << 20
    probe = FakeProbe(allocated=[1000, 1200], peak=1700, used=[2 * GIB + graphs, 2 * GIB], total=8 * GIB)
    _, profile = kv_pool_blocks(model, spec, config, torch.device("cpu"), torch.float32, probe=probe)
    assert profile is not None and profile.runner_memory == graphs
    headroom = SAMPLER_COPIES * 64 * 256 * 4
    assert profile.kv_budget == 4 * GIB - 2 * GIB - graphs - 500 - headroom


def test_explicit_sizes_skip_the_profile(tiny_model: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model("llama")), device="cpu", num_kv_blocks=4)
    model, spec = llm.engine.runner.model, models.kv_spec(llm.engine.runner.model.config)
    config = resolved(EngineConfig(max_model_len=256, kv_cache_memory_bytes=1 << 20, block_size=16), CUDA)
    probe = FakeProbe([], 0, 0, 0)
    blocks, profile = kv_pool_blocks(model, spec, config, torch.device("cpu"), torch.float32, probe=probe)
    assert profile is None and probe.clears == 0
    assert blocks == (1 << 20) // 8192  # 8 KiB a block (see the test above)


@pytest.mark.parametrize("accelerate", [True, False])
def test_weights_go_straight_to_the_device_when_transformers_can(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, accelerate: bool
) -> None:
    seen: dict[str, object] = {}
    real = models.AutoModelForCausalLM.from_pretrained

    def from_pretrained(path: str, **kwargs: object) -> object:
        seen.update(kwargs)
        kwargs.pop("device_map", None)
        return real(path, **kwargs)

    monkeypatch.setattr(models, "is_accelerate_available", lambda: accelerate)
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    device = torch.device("meta")  # stands in for a GPU: not the CPU, allocates nothing
    model = models.load_model(str(tiny_model("llama")), device, torch.float32)
    assert next(model.parameters()).device == device
    assert seen.get("device_map") == ({"": device} if accelerate else None)


@pytest.mark.parametrize("value", [0, 1.5, True, "0.9", float("nan")])
def test_gpu_memory_utilization_is_checked(value: object) -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.gpu_memory_utilization must be a number in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=value)  # type: ignore[arg-type]
    assert EngineConfig(gpu_memory_utilization=1).gpu_memory_utilization == 1


def test_a_profiling_forward_that_runs_out_of_memory_names_the_settings() -> None:
    from batchgen.engine.runner.pool_sizing import profile_kv_budget

    class Runner:
        def execute(self, batch: object) -> object:
            raise torch.OutOfMemoryError("CUDA out of memory")

    batch = profile_batch(max_batched_tokens=100, max_num_seqs=8, max_model_len=300, block_size=16)
    probe = FakeProbe(allocated=[0, 0], peak=0, used=0, total=GIB)
    with pytest.raises(ValueError, match=r"93 tokens after 207 tokens of context.*lower max_num_batched_tokens"):
        profile_kv_budget(lambda blocks: Runner(), batch, probe, 256, 0.9)
