"""Section "env" of benchmarks/gpu_check.py: versions, the GPU, the attention path and backend per
setting, and which kernels each call shape (prefill, continuation chunk, decode, mixed) launches."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers

from batchgen import LLM
from batchgen.engine.api.config import engine_config
from batchgen.engine.attention import path as attention_path
from batchgen.engine.core.runner_output import ModelRunnerOutput
from batchgen.engine.core.scheduler_output import ScheduledBatch
from batchgen.engine.platforms import platform_for
from benchmarks.gpu_check_common import Ctx, free_memory, greedy, save_model

ATTENTION_OPS = ("attention", "flash", "fmha", "varlen", "softmax", "index_select", "bmm", "cutlass", "triton", "_attn")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPY_CALLS = ("cudaMemcpyAsync", "cudaMemcpy")


def backend_refusal(name: str, device: torch.device) -> str | None:
    """Why the engine refuses attention_backend `name` on `device` (None: it takes it)."""
    try:
        engine_config(attention_backend=name)
        platform_for(device).attention_backend(name)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def step_shape(batch: ScheduledBatch) -> str:
    decodes = [c.is_decode for c in batch.chunks]
    if all(decodes):
        return "decode"
    if any(decodes):
        return "mixed"
    return "continuation" if any(c.start > 0 for c in batch.chunks) else "prefill"


@contextlib.contextmanager
def capture_batches(llm: LLM) -> Iterator[list[ScheduledBatch]]:
    runner, seen = llm.engine.runner, []
    real = runner.execute

    def execute(batch: ScheduledBatch) -> ModelRunnerOutput:
        seen.append(batch)
        return real(batch)

    runner.execute = execute  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        runner.execute = real  # type: ignore[method-assign]


def profiled_steps(llm: LLM, device: str, steps: int = 1) -> tuple[list[str], list[str], dict[str, int]]:
    """`steps` engine steps under the torch profiler -> (their shapes, attention-ish ops, API calls).

    Why the sync before and none inside: the window holds the engine's calls only, so every
    synchronize or copy the profiler counts is the engine's, never this script's."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with capture_batches(llm) as seen, torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            llm.engine.step()
    events = prof.key_averages()
    names = {e.key: e.count for e in events}
    ops = sorted(k for k in names if any(p in k.lower() for p in ATTENTION_OPS))
    calls = {k: names.get(k, 0) for k in (*SYNC_CALLS, *COPY_CALLS)}
    # why: with no CUPTI the profiler sees no CUDA activity, and zero syncs would be a false figure
    calls["cuda_events"] = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return [step_shape(b) for b in seen], ops[:20], calls


def call_shapes(path: Path, device: str, dtype: torch.dtype, block_size: int) -> dict[str, Any]:
    """Run prefill / continuation / decode / mixed steps and record what each launched."""
    llm = LLM(
        str(path),
        device=device,
        dtype=dtype,
        block_size=block_size,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        enable_prefix_caching=False,
        num_kv_blocks=64,
        compile=False,
    )
    runner = llm.engine.runner
    shapes: dict[str, Any] = {}
    for prompts in ([[5] * 100], [[7] * 600], [[9] * 100, [11] * 600]):
        for p in prompts:
            llm.engine.add_request(p, greedy(3))
        while llm.engine.has_unfinished():
            shape, ops, calls = profiled_steps(llm, device)
            shapes.setdefault(shape[0], {"ops": ops, "api_calls": calls})
    result = {"path": runner.attention.path, "backend": runner.backend.describe(), "shapes": shapes}
    del llm, runner
    free_memory()
    return result


def versions_and_gpu(device: torch.device) -> dict[str, Any]:
    gpu: dict[str, Any] | None = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "capability": list(torch.cuda.get_device_capability(device)),
            "total_gib": round(props.total_memory / 2**30, 1),
        }
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "gpu": gpu,
        "accelerate_installed": transformers.utils.is_accelerate_available(),
    }


def run(ctx: Ctx, out: dict[str, Any]) -> None:
    from batchgen.engine.runner.models import resolve_device

    device = resolve_device(ctx.sizes.device)
    out.update(versions_and_gpu(device))
    support = attention_path.detect_support(device)
    out["varlen_paged_supported"] = support.varlen_paged
    out["path_choice"] = {
        f"{str(dt).removeprefix('torch.')}/block{bs}": asdict(
            attention_path.choose_attention_path(device.type, dt, bs, 64, False, support)
        )
        for dt in (torch.bfloat16, torch.float16, torch.float32)
        for bs in (16, 256)
    }
    out["backends"] = {}
    for name in ("auto", "torch", "triton"):
        why = backend_refusal(name, device)
        out["backends"][name] = (
            {"refused": why} if why else {"resolves_to": platform_for(device).attention_backend(name)}
        )
    ctx.save()
    tiny = save_model(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
        ),
        ctx.work / "tiny-shapes",
        ctx.sizes.device,
    )
    out["observed"] = {"float32/block16": call_shapes(tiny, ctx.sizes.device, torch.float32, 16)}
    if device.type == "cuda":  # (the smoke run keeps to one: the CPU takes the same path for each)
        for name, dtype, block in (
            ("bfloat16/block16", torch.bfloat16, 16),
            ("bfloat16/block256", torch.bfloat16, 256),
        ):
            if ctx.unit(out, f"observed {name}", 3):
                out["observed"][name] = call_shapes(tiny, ctx.sizes.device, dtype, block)
                ctx.save()
