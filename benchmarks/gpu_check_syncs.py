"""Section "syncs" of benchmarks/gpu_check.py: what one decode step costs in host syncs, per sampling
feature, eager and compiled with CUDA-graph decode (tiny float32 Llama).

Two counts side by side, both over the same decode steps: the engine's own (runner.transfers:
uploads, reads and why each read happened; graphs compiled; CUDA graphs captured and replayed)
and, on CUDA, the torch profiler's count of synchronize and memcpy calls in a window that holds
engine steps only (the script syncs before the window, never inside). Where the profiler sees
more syncs than the engine counts reads, a feature syncs outside Transfers (issue 31, point 4).
Each measured run follows a warm-up of the same shapes, so compiling and capturing stay out of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from benchmarks.gpu_check_common import Ctx, counters_delta, engine_counters, free_memory, random_prompts
from benchmarks.gpu_check_compiled import compiled_llm
from benchmarks.gpu_check_env import SYNC_CALLS, profiled_steps
from benchmarks.gpu_check_parity import engine_llm

CONFIGS = ("eager", "compiled_graphs")


def _params(**kw: Any) -> Callable[[int, int], SamplingParams]:
    return lambda i, max_tokens: SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


FEATURES: dict[str, Callable[[int, int], SamplingParams]] = {
    "greedy": _params(temperature=0.0),
    "top_p_top_k": _params(temperature=0.8, top_p=0.9, top_k=20),
    "seeded_and_unseeded": lambda i, m: SamplingParams(
        max_tokens=m, ignore_eos=True, temperature=0.8, seed=i if i % 2 else None
    ),
    "logprobs": _params(temperature=0.0, logprobs=5),
    "penalties": _params(temperature=0.0, repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5),
    "n2": _params(temperature=0.8, n=2, seed=1),
    "all": _params(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        logprobs=5,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        seed=3,
        n=2,
        logit_bias={5: 1.0, 7: -2.0},
    ),
}


def prefilled(llm: LLM) -> bool:
    scheduler = llm.engine.scheduler
    return not scheduler.waiting and all(s.num_computed_tokens >= s.num_prompt_tokens for s in scheduler.running)


def measure(ctx: Ctx, llm: LLM, feature: str) -> dict[str, Any]:
    """Warm up, then profile sync_steps decode steps of sync_requests requests with `feature`."""
    s, make = ctx.sizes, FEATURES[feature]
    max_tokens = s.sync_steps + 2  # a token from the prefill, the window's, one more: none ends inside it
    warm = random_prompts(s.sync_requests, (8, 24), 256, seed=12, token_seed=1)
    llm.generate(warm, [make(i, max_tokens) for i in range(len(warm))])
    for i, p in enumerate(random_prompts(s.sync_requests, (8, 24), 256, seed=12, token_seed=2)):
        llm.engine.add_request(p, make(i, max_tokens))
    while not prefilled(llm):
        llm.engine.step()
    before = engine_counters(llm)
    shapes, _, calls = profiled_steps(llm, s.device, s.sync_steps)
    counts = counters_delta(before, engine_counters(llm))
    while llm.engine.has_unfinished():
        llm.engine.step()
    steps = max(len(shapes), 1)
    profiled = s.device == "cuda" and calls["cuda_events"] > 0
    return {
        "shapes": sorted(set(shapes)),
        "engine": counts,
        "profiler_syncs_per_step": round(sum(calls[k] for k in SYNC_CALLS) / steps, 2) if profiled else None,
        "profiler_calls_per_step": {k: round(v / steps, 2) for k, v in calls.items()} if profiled else None,
    }


def hidden_syncs(row: dict[str, Any]) -> str | None:
    """Why a feature syncs outside Transfers, or None: the profiler's stream syncs per step above the
    engine's own reads (each read is one stream sync). Why stream syncs only: the one device sync in
    a window is the profiler's own, at its edge (0.12 a step over 8 steps on the first H200 run)."""
    calls = row["profiler_calls_per_step"]
    if calls is None:
        return None
    seen, reads = calls["cudaStreamSynchronize"], row["engine"]["reads_per_step"]
    if seen <= reads + 0.01:
        return None
    return f"{seen} stream syncs a step, {reads} engine reads: a sync outside Transfers"


def section_syncs(ctx: Ctx, out: dict[str, Any]) -> None:
    """On the graphs section's setting: its compiled engine (made now if that section did not run)."""
    setting = ctx.sizes.graphs_setting
    out["setting"] = setting
    out["per_feature"] = "engine: Transfers' counts per decode step; profiler: every sync call in the same steps"
    if ctx.sizes.device == "cuda":
        out["profiler_note"] = "null profiler figures: the profiler saw no CUDA activity (no CUPTI?)"
    for config in CONFIGS:
        if not ctx.unit(out, config, ctx.sizes.estimate_s["syncs"] / len(CONFIGS)):
            continue
        eager = config == "eager"  # eager: the device's default backend
        llm = engine_llm(ctx, "llama", setting) if eager else compiled_llm(ctx, "llama", setting)
        features = FEATURES if eager else ctx.sizes.graph_sync_features or FEATURES
        rows = {feature: measure(ctx, llm, feature) for feature in features}
        for feature, row in rows.items():
            dirty = {k: row["engine"][k] for k in ("compiled_graphs", "captures") if row["engine"].get(k)}
            if dirty:
                out.setdefault("failures", []).append(f"{config}/{feature}: {dirty} in the measured steps")
            hidden = hidden_syncs(row)
            if hidden:
                out.setdefault("failures", []).append(f"{config}/{feature}: {hidden}")
        out[config] = {"backend": llm.engine.runner.backend.describe(), "features": rows}
        del llm
        free_memory()
        ctx.save()
