"""Section "throughput" of benchmarks/gpu_check.py: a 1B-class bf16 Llama (random weights, built from
Llama-3.2-1B's config; the smoke run: the tiny float32 Llama, so its compile reuses the earlier
sections') through transformers `generate` at a few batch sizes and through the engine eager and
compiled (with CUDA-graph decode), side by side in one process: output tokens/s, the ratio to
generate's best batch size, greedy agreement (not exact in bf16: padding, kernels), memory, and
the engine's own counters.

Why a warm-up of the same shapes: before each engine variant is timed it runs the same workload
once with other token values (the same lengths, so the same steps, token counts, decode batches,
graph widths and staging offsets; other tokens, so nothing is a prefix-cache hit). Every graph
the compiled forward needs and every CUDA graph the decodes replay are made then, and the timed
run must make none: the section fails when the engine counts a recompile or a capture in it.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers as tf

from batchgen import LLM
from benchmarks.gpu_check_common import (
    EOS,
    Ctx,
    common_prefix,
    counters_delta,
    engine_counters,
    free_memory,
    greedy,
    hf_generate,
    load_hf,
    random_prompts,
    save_model,
    tokens_of,
)
from benchmarks.gpu_check_compiled import drop_compiled, with_graphs

GIB = 2**30
VARIANTS: dict[str, dict[str, Any]] = {"eager": {"compile": False}, "compiled": {"compile": True}}


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs to three significant figures (two decimals read a slow stand-in's 0.004 as 0)."""
    return float(f"{ours / theirs:.3g}")


def big_model(ctx: Ctx) -> Path:
    config = tf.LlamaConfig(**ctx.sizes.big, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS)
    return save_model(config, ctx.work / "big", ctx.sizes.device, getattr(torch, ctx.sizes.big_dtype))


def workload(ctx: Ctx, token_seed: int | None = None, prefix: list[int] | None = None) -> list[list[int]]:
    s = ctx.sizes
    lens = s.prompt_lens if prefix is None else (s.prompt_lens[0] // 4, s.prompt_lens[0])
    return random_prompts(s.n_prompts, lens, s.big["vocab_size"], 3, prefix, token_seed)


def timed(ctx: Ctx, fn: Any) -> tuple[Any, float, int]:
    """fn() between two of the script's own syncs -> (its result, seconds, script syncs made)."""
    syncs = ctx.script_syncs
    ctx.sync()
    start = time.perf_counter()
    result = fn()
    ctx.sync()
    return result, time.perf_counter() - start, ctx.script_syncs - syncs


def hf_sweep(ctx: Ctx, model: Any, prompts: list[list[int]], batches: list[int], out: dict[str, Any]) -> dict[str, Any]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows: dict[int, dict[str, Any]] = {}
    tokens: dict[int, list[list[int]]] = {}
    last = 0.0
    for bs in batches:
        if rows and not ctx.unit(out, f"generate batch {bs}", 1.5 * last):  # smaller batches run longer
            continue

        def run(bs: int = bs) -> dict[int, list[int]]:
            got = {}
            for b in range(0, len(order), bs):
                rows_of = order[b : b + bs]
                outs = hf_generate(model, [prompts[i] for i in rows_of], ctx.sizes.out_tokens, ctx.sizes.device)
                got.update(zip(rows_of, outs))
            return got

        got, seconds, _ = timed(ctx, run)
        last = seconds
        tokens[bs] = [got[i] for i in range(len(prompts))]
        rows[bs] = {
            "seconds": round(seconds, 2),
            "output_tok_s": round(len(prompts) * ctx.sizes.out_tokens / seconds, 1),
        }
    best = max(rows, key=lambda b: rows[b]["output_tok_s"])
    return {"by_batch_size": rows, "best_batch_size": best, **rows[best], "tokens": tokens[best]}


def memory_of(llm: LLM, free_before: int | None) -> dict[str, Any]:
    runner = llm.engine.runner
    cuda = runner.device.type == "cuda"
    profile = llm.memory_profile
    return {
        "pool_blocks": runner.num_kv_blocks,
        "block_size": runner.block_size,
        "pool_gib": round(sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches) / GIB, 3),
        "free_before_load_gib": None if free_before is None else round(free_before / GIB, 2),
        # peak of the timed run; graphs' private pools count as allocated, so a graph pool that outgrew
        # the KV budget shows as a peak near the total and little free memory after
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else None,
        "reserved_gib": round(torch.cuda.memory_reserved() / GIB, 2) if cuda else None,
        "free_after_gib": round(torch.cuda.mem_get_info()[0] / GIB, 2) if cuda else None,
        "profile": None if profile is None else dict(vars(profile)),
    }


def timed_generate(ctx: Ctx, llm: LLM, prompts: list[list[int]], warm: list[list[int]]) -> dict[str, Any]:
    """Warm up on `warm` (the same shapes), then time `prompts`; the engine's counters for each."""
    s, cuda = ctx.sizes, ctx.sizes.device == "cuda"
    start = engine_counters(llm)
    _, warm_s, _ = timed(ctx, lambda: llm.generate(warm, greedy(s.out_tokens)))
    before, stats0 = engine_counters(llm), llm.stats
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    outs, seconds, script_syncs = timed(ctx, lambda: llm.generate(prompts, greedy(s.out_tokens)))
    produced = sum(o.num_output_tokens for o in outs)
    return {
        "seconds": round(seconds, 2),
        "output_tok_s": round(produced / seconds, 1),
        "warmup_seconds": round(warm_s, 1),
        "stats": {k: v - stats0[k] for k, v in llm.stats.items()},
        "engine_counters_timed": counters_delta(before, engine_counters(llm)),
        "engine_counters_warmup": counters_delta(start, before),
        "script_syncs_timed": script_syncs,
        "tokens": tokens_of(outs),
    }


def engine_variant(ctx: Ctx, path: Path, name: str, runs: dict[str, tuple[list[list[int]], ...]]) -> dict[str, Any]:
    """Load the engine of variant `name` once and run each workload (prompts, warm-up prompts) on it."""
    s = ctx.sizes
    free_before = torch.cuda.mem_get_info()[0] if s.device == "cuda" else None
    began = time.perf_counter()
    settings = {**s.engine, **VARIANTS[name]}
    if settings["compile"]:  # the backend the graphs run with (the CPU stand-in's: torch)
        settings["attention_backend"] = s.graph_backend
    llm = LLM(str(path), device=s.device, dtype=s.big_dtype, **settings)
    if llm.engine.runner.forward.compile:
        with_graphs(llm, s.graph_standin)
    runner = llm.engine.runner
    result: dict[str, Any] = {
        "load_seconds": round(time.perf_counter() - began, 1),
        "backend": runner.backend.describe(),
        "attention_path": runner.attention.path,
        "compiled": runner.forward.compile,
        "cuda_graphs": runner.graphs is not None,
    }
    for label, (prompts, warm) in runs.items():
        result[label] = timed_generate(ctx, llm, prompts, warm)
    result["memory"] = memory_of(llm, free_before)
    del llm, runner
    free_memory()
    return result


def timing_clean(out: dict[str, Any], name: str, run: dict[str, Any]) -> None:
    """Zero recompiles and zero graph captures in the timed run, or the section fails."""
    counts = run["engine_counters_timed"]
    dirty = {k: counts[k] for k in ("compiled_graphs", "captures") if counts.get(k)}
    run["timing_clean"] = not dirty
    if dirty:
        out.setdefault("failures", []).append(f"{name}: {dirty} inside the timed run (its figure includes them)")


def agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    lengths = [common_prefix(a, b) for a, b in zip(got, want)]
    return {
        "identical": sum(a == b for a, b in zip(got, want)),
        "of": len(want),
        "median_len": statistics.median(lengths),
    }


def section_throughput(ctx: Ctx, out: dict[str, Any]) -> None:
    s = ctx.sizes
    drop_compiled(ctx)  # the parity sections' engines: free their memory before the big model's
    path = big_model(ctx)
    prompts, warm = workload(ctx), workload(ctx, token_seed=1)
    out["workload"] = f"{len(prompts)} prompts of {s.prompt_lens} tokens, {s.out_tokens} output tokens each, greedy"
    out["dtype"] = s.big_dtype
    model = load_hf(path, s.device, getattr(torch, s.big_dtype), "sdpa")
    out["params"] = sum(p.numel() for p in model.parameters())
    hf_generate(model, warm[:2], 2, s.device)  # warm-up
    hf = hf_sweep(ctx, model, prompts, s.hf_batches, out)
    hf_tokens = hf.pop("tokens")
    out["hf_generate"] = hf
    ctx.save()
    runs: dict[str, tuple[list[list[int]], ...]] = {"main": (prompts, warm)}
    if ctx.unit(out, "shared prefix", 2 * hf["seconds"]):
        vocab = s.big["vocab_size"]
        preambles = [random_prompts(1, (s.shared_prefix,) * 2, vocab, seed=4, token_seed=t)[0] for t in (4, 5)]
        runs["shared_prefix"] = (workload(ctx, 2, preambles[0]), workload(ctx, 3, preambles[1]))
        out["shared_prefix"] = {"workload": f"{s.shared_prefix}-token shared preamble + own tokens, eager engine"}
        shared_hf = hf_sweep(ctx, model, runs["shared_prefix"][0], [hf["best_batch_size"]], out)
        shared_hf.pop("tokens")
        out["shared_prefix"]["hf_generate"] = shared_hf
    del model
    free_memory()
    for name in VARIANTS:
        if name != "eager" and not ctx.unit(out, f"engine {name}", s.estimate_s[f"throughput.{name}"]):
            continue
        run = engine_variant(ctx, path, name, runs if name == "eager" else {"main": runs["main"]})
        main = run.pop("main")
        tokens = main.pop("tokens")
        run.update(main)
        run["over_hf_best"] = ratio(run["output_tok_s"], hf["output_tok_s"])
        run["greedy_agreement_vs_hf"] = agreement(tokens, hf_tokens)
        if "eager" in ctx.cache.get("perf_tokens", {}):
            run["greedy_agreement_vs_eager"] = agreement(tokens, ctx.cache["perf_tokens"]["eager"])
        ctx.cache.setdefault("perf_tokens", {})[name] = tokens
        timing_clean(out, name, run)
        if "shared_prefix" in run:
            shared_run = run.pop("shared_prefix")
            shared_run.pop("tokens")
            timing_clean(out, f"{name}/shared_prefix", shared_run)
            out["shared_prefix"]["engine_eager"] = shared_run
            out["shared_prefix"]["over_hf"] = ratio(
                shared_run["output_tok_s"], out["shared_prefix"]["hf_generate"]["output_tok_s"]
            )
        out[name] = run
        ctx.save()
    ctx.cache.pop("perf_tokens", None)
    drop_compiled(ctx)
