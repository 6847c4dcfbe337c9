"""Sections "parity" and "triton" of benchmarks/gpu_check.py: greedy token parity in float32.

parity: the engine eager with the portable torch backend vs transformers' `generate`, for the
parity tests' tiny architectures, under pressure (chunked prefill, prefix caching, preemption)
and relaxed (big steps). triton: the same with attention_backend "triton", against both
transformers and the eager torch engine's tokens; skipped, with the engine's reason, where the
engine refuses that backend. The references load transformers' "eager" attention: its default
(sdpa) drops Gemma 2's soft-capping and would fail parity falsely. Every engine here gets a small
explicit KV pool: sized from free memory, a tiny model would get ~16M blocks on an H200.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch

from batchgen import LLM
from batchgen.engine.runner.models import resolve_device
from benchmarks.gpu_check_common import (
    Ctx,
    compare,
    free_memory,
    greedy,
    hf_generate,
    load_hf,
    random_prompts,
    save_model,
    tokens_of,
)
from benchmarks.gpu_check_env import backend_refusal
from testkit.tiny_models import tiny_configs

REFERENCE_ATTENTION = "eager"
PARITY_SETTINGS: dict[str, dict[str, Any]] = {
    "pressure": dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=24),
    "relaxed": dict(
        block_size=16, max_num_batched_tokens=1024, max_num_seqs=64, enable_prefix_caching=False, num_kv_blocks=2048
    ),
    # the graphs section's: a pool big enough that every decode-only step fits a graph (bucket x width
    # blocks within the pool: cuda/graphs), a budget that admits a batch at once so decode-only steps come
    "graphs": dict(block_size=16, max_num_batched_tokens=256, max_num_seqs=16, num_kv_blocks=640),
}


def parity_prompts(n: int) -> tuple[list[list[int]], list[int]]:
    """n prompts of 1-300 random tokens and n sharing a 96-token prefix; max_tokens 1-12."""
    shared = random_prompts(1, (96, 96), 256, seed=7)[0]
    prompts = random_prompts(n, (1, 300), 256, seed=8) + random_prompts(n, (0, 60), 256, seed=9, prefix=shared)
    return prompts, [1 + i % 12 for i in range(len(prompts))]


def tiny_model(ctx: Ctx, arch: str) -> Path:
    return save_model(tiny_configs()[arch], ctx.work / f"parity-{arch}", ctx.sizes.device)


def reference(ctx: Ctx, arch: str) -> list[list[int]]:
    """transformers' greedy tokens, float32, eager attention, one unpadded prompt at a time (cached)."""
    key = f"hf:{arch}"
    if key not in ctx.cache:
        prompts, max_tokens = parity_prompts(ctx.sizes.parity_prompts)
        model = load_hf(tiny_model(ctx, arch), ctx.sizes.device, torch.float32, REFERENCE_ATTENTION)
        ctx.cache[key] = [hf_generate(model, [p], m, ctx.sizes.device)[0] for p, m in zip(prompts, max_tokens)]
        del model
        free_memory()
    return ctx.cache[key]  # type: ignore[no-any-return]


def engine_llm(ctx: Ctx, arch: str, setting: str, **extra: Any) -> LLM:
    settings = {"compile": False, **PARITY_SETTINGS[setting], **extra}
    return LLM(str(tiny_model(ctx, arch)), device=ctx.sizes.device, dtype="float32", **settings)


def run_parity(llm: LLM, ctx: Ctx) -> list[list[int]]:
    prompts, max_tokens = parity_prompts(ctx.sizes.parity_prompts)
    return tokens_of(llm.generate(prompts, [greedy(m) for m in max_tokens]))


def eager_torch(ctx: Ctx, arch: str, setting: str) -> list[list[int]]:
    """The eager torch backend's tokens (cached): what every other path is also compared with."""
    key = f"torch:{arch}:{setting}"
    if key not in ctx.cache:
        llm = engine_llm(ctx, arch, setting, attention_backend="torch")
        ctx.cache[key] = run_parity(llm, ctx)
        del llm
        free_memory()
    return ctx.cache[key]  # type: ignore[no-any-return]


def verdict(out: dict[str, Any], where: str, row: dict[str, Any]) -> None:
    """Record a failure in out["failures"] unless every prompt matched every reference in `row`."""
    for ref in ("vs_transformers", "vs_eager_torch"):
        got = row.get(ref)
        if got is not None and got["matched"] != got["of"]:
            out.setdefault("failures", []).append(f"{where}: {got['of'] - got['matched']} prompts differ {ref}")


def section_parity(ctx: Ctx, out: dict[str, Any]) -> None:
    archs = ctx.sizes.archs
    out["reference_attention"] = REFERENCE_ATTENTION
    out["prompts"] = 2 * ctx.sizes.parity_prompts
    for arch in archs:
        if not ctx.unit(out, arch, ctx.sizes.estimate_s["parity"] / len(archs)):
            continue
        want = reference(ctx, arch)
        row: dict[str, Any] = {}
        for setting in ctx.sizes.parity_settings:
            row[setting] = {"vs_transformers": compare(eager_torch(ctx, arch, setting), want)}
            verdict(out, f"{arch}/{setting}", row[setting])
        out[arch] = row
        ctx.save()
    out["all_matched"] = not out.get("failures") and not out.get("cut")


def refused_by_engine(exc: BaseException) -> bool:
    """Whether `exc` is the engine refusing a backend (raised by a Platform's attention_backend or by
    engine/platforms.make_backend)."""
    if not isinstance(exc, (ValueError, ImportError, NotImplementedError)):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    names, files = ("attention_backend", "make_backend"), ("platform.py", "platforms.py")
    return any(f.name in names and f.filename.endswith(files) for f in frames)


def section_triton(ctx: Ctx, out: dict[str, Any]) -> None:
    why = backend_refusal("triton", resolve_device(ctx.sizes.device))
    if why is not None:
        out["skipped"] = f"attention_backend 'triton' not available: {why}"
        return
    archs = ctx.sizes.triton_archs
    out["reference_attention"] = REFERENCE_ATTENTION
    for arch in archs:
        if not ctx.unit(out, arch, ctx.sizes.estimate_s["triton"] / len(archs)):
            continue
        row: dict[str, Any] = {}
        for setting in ctx.sizes.triton_settings:
            try:
                llm = engine_llm(ctx, arch, setting, attention_backend="triton")
            except Exception as exc:
                if not refused_by_engine(exc):
                    raise
                out["skipped"] = f"attention_backend 'triton' not available: {exc}"
                return
            got = run_parity(llm, ctx)
            row[setting] = {
                "backend": llm.engine.runner.backend.describe(),
                "vs_transformers": compare(got, reference(ctx, arch)),
                "vs_eager_torch": compare(got, eager_torch(ctx, arch, setting)),
            }
            verdict(out, f"{arch}/{setting}", row[setting])
            del llm
            free_memory()
        out[arch] = row
        ctx.save()
    out["all_matched"] = not out.get("failures") and not out.get("cut")
