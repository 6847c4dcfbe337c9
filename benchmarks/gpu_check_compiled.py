"""Sections "compiled" and "graphs" of benchmarks/gpu_check.py: greedy token parity in float32 of
the compiled forward (engine.compile true, CUDA graphs held off) under pressure (chunked prefill,
prefix caching, preemption), and of CUDA-graph decode steps with a pool big enough that every
decode-only step fits a graph, against transformers and the eager torch engine.

Each engine compiles its own forward (dynamo keeps one per engine; a second one of the same model
mostly hits inductor's cache of the first), so engines are kept for the sections after: the
smoke run gives both sections one setting, and the syncs section measures on the graphs
section's engine. On the CPU (--smoke) the
CUDA graphs are stood in for: capture keeps the step's context and call, replay runs that call
again on the static buffers, which is what replaying a captured graph computes; buckets, the
capture of every bucket before the first step, static buffers, the triton backend's graph plan
(its interpreter) and the capture count are the engine's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from batchgen import LLM
from batchgen.engine.cuda.graphs import GraphDecode
from benchmarks.gpu_check_common import (
    Ctx,
    compare,
    counters_delta,
    engine_counters,
    free_memory,
)
from benchmarks.gpu_check_parity import eager_torch, engine_llm, reference, run_parity, verdict


class ReplayByRerun(GraphDecode):
    """GraphDecode without CUDA (the --smoke stand-in): replay reruns the captured call."""

    def capture(self, bucket: int, run: Callable[[Callable[[], torch.Tensor]], torch.Tensor]) -> None:
        call = self.step_call(bucket)
        self.graphs[bucket] = lambda: run(call)  # type: ignore[assignment]

    def replay(self, bucket: int, n: int) -> torch.Tensor:
        return self.graphs[bucket]()[:n]  # type: ignore[operator]


def install_standin(llm: LLM) -> None:
    """The runner's graphs as on CUDA (every bucket captured before the first step), stood in for."""
    runner = llm.engine.runner
    max_blocks = -(-llm.max_model_len // runner.block_size)
    rows = int(llm.config.max_num_seqs or 64)
    graphs = ReplayByRerun(runner.forward, rows, max_blocks, runner.block_size, runner.device)
    graphs.capture_all(runner._graph_run, runner._graph_context)
    runner.graphs = graphs


def with_graphs(llm: LLM, standin: bool) -> LLM:
    """`llm` with its decode graphs (the CPU stand-in when asked), their replays counted."""
    if standin and llm.engine.runner.graphs is None:
        install_standin(llm)
    return llm


def compiled_llm(ctx: Ctx, arch: str, setting: str) -> LLM:
    """The compiled engine of `arch` with PARITY_SETTINGS[setting] (its graphs made, replays counted),
    kept for the sections after (compiled, graphs and syncs may share one) until drop_compiled."""
    key = f"compiled:{arch}:{setting}"
    if key not in ctx.cache:
        llm = engine_llm(ctx, arch, setting, compile=True, attention_backend=ctx.sizes.graph_backend)
        ctx.cache[key] = with_graphs(llm, ctx.sizes.graph_standin)
    return ctx.cache[key]  # type: ignore[no-any-return]


def drop_compiled(ctx: Ctx) -> None:
    """Free the kept compiled engines (before the big model loads, and after it).

    Why not torch._dynamo.reset() too: it also drops what makes the next compile of the same graph
    take seconds instead of tens of them (measured on the CPU: 2.8 s against 12-18 s)."""
    for key in [k for k in ctx.cache if k.startswith("compiled:")]:
        del ctx.cache[key]
    free_memory()


def parity_row(ctx: Ctx, arch: str, setting: str, llm: LLM) -> dict[str, Any]:
    before = engine_counters(llm)
    got = run_parity(llm, ctx)
    counts = counters_delta(before, engine_counters(llm))
    forward = llm.engine.runner.forward
    return {
        "setting": setting,
        "vs_transformers": compare(got, reference(ctx, arch)),
        "vs_eager_torch": compare(got, eager_torch(ctx, arch, setting)),
        "backend": llm.engine.runner.backend.describe(),
        "still_compiled": forward.compile,
        "compiled_graphs_total": forward.stats.graphs,
        "compile_seconds_total": round(forward.stats.seconds, 2),
        "compiled_shapes": sorted(forward.stats.shapes),
        "counters": counts,
    }


def section_compiled(ctx: Ctx, out: dict[str, Any]) -> None:
    archs, setting = ctx.sizes.compiled_archs, ctx.sizes.compiled_setting
    for arch in archs:
        if not ctx.unit(out, arch, ctx.sizes.estimate_s["compiled"] / len(archs)):
            continue
        llm = compiled_llm(ctx, arch, setting)
        runner = llm.engine.runner
        graphs, runner.graphs = runner.graphs, None  # why: this section is the compiled forward alone
        try:
            row = parity_row(ctx, arch, setting, llm)
        finally:
            runner.graphs = graphs
        verdict(out, arch, row)
        if not row["still_compiled"] or row["compiled_graphs_total"] < 1:
            out.setdefault("failures", []).append(f"{arch}: the forward did not run compiled")
        out[arch] = row
        ctx.save()
    out["all_matched"] = not out.get("failures") and not out.get("cut")


def section_graphs(ctx: Ctx, out: dict[str, Any]) -> None:
    archs, setting = ctx.sizes.compiled_archs, ctx.sizes.graphs_setting
    out["graphs"] = "CPU stand-in: replay reruns the call on the static buffers" if ctx.sizes.graph_standin else "cuda"
    for arch in archs:
        if not ctx.unit(out, arch, ctx.sizes.estimate_s["graphs"] / len(archs)):
            continue
        llm = compiled_llm(ctx, arch, setting)
        if llm.engine.runner.graphs is None:
            out.setdefault("failures", []).append(f"{arch}: the engine made no decode graphs (device/attention path)")
            continue
        row = parity_row(ctx, arch, setting, llm)
        verdict(out, arch, row)
        if not row["counters"]["replays"]:
            out.setdefault("failures", []).append(f"{arch}: no decode step replayed a graph; nothing was compared")
        if llm.engine.runner.graphs.captures_after_start:
            out.setdefault("failures", []).append(f"{arch}: a graph was captured after the engine started")
        out[arch] = row
        ctx.save()
    out["all_matched"] = not out.get("failures") and not out.get("cut")
