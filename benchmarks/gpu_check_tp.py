"""Section "tp" of benchmarks/gpu_check.py: tensor parallelism (engine.tensor_parallel_size 2).

Run only where it means something: on CUDA with 2+ GPUs (NCCL between them), and on the CPU in
--smoke (gloo), so the code stays alive. On a one-GPU machine it is skipped and says so, with the
GPU count. What it checks: the parity prompts under pressure, greedy, give the single-device eager
engine's tokens (itself checked against transformers by section "parity") for the architectures
with a sharding plan; it records the group's start and the run's seconds beside the single device's.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from batchgen.engine.parallel.plan import SHARDABLE
from benchmarks.gpu_check_common import Ctx, compare, free_memory
from benchmarks.gpu_check_parity import eager_torch, engine_llm, run_parity
from testkit.tiny_models import tiny_configs

SIZE = 2


def section_tp(ctx: Ctx, out: dict[str, Any]) -> None:
    device = ctx.sizes.device
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    out.update(gpus=gpus, tensor_parallel_size=SIZE)
    if device == "cuda" and gpus < SIZE:
        out["skipped"] = (
            f"{gpus} GPU(s) on this machine: tensor parallelism needs {SIZE} or more "
            "(the CPU path, over gloo, is tested by tests/engine/test_tensor_parallel.py)"
        )
        return
    out["collectives"] = "nccl" if device == "cuda" else "gloo"
    archs = [a for a in ctx.sizes.archs if tiny_configs()[a].get_text_config().model_type in SHARDABLE]
    for arch in archs:
        if not ctx.unit(out, arch, ctx.sizes.estimate_s["tp"] / len(archs)):
            continue
        want = eager_torch(ctx, arch, "pressure")
        start = time.perf_counter()
        llm = engine_llm(ctx, arch, "pressure", attention_backend="torch", tensor_parallel_size=SIZE)
        try:
            started = time.perf_counter()
            got = run_parity(llm, ctx)
            row = {"vs_tp1": compare(got, want), "start_s": round(started - start, 2)}
            row["run_s"] = round(time.perf_counter() - started, 2)
        finally:
            llm.close()
            free_memory()
        if row["vs_tp1"]["matched"] != row["vs_tp1"]["of"]:
            out.setdefault("failures", []).append(f"{arch}: {row['vs_tp1']} vs the single-device engine")
        out[arch] = row
        ctx.save()
