"""Sections 3 (throughput) and 4 (memory) of benchmarks/gpu_check.py (run that script)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from batchgen.engine.llm import LLM
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sampling.stopping import StopChecker
from benchmarks.gpu_check import (
    SYNC_CALLS,
    Sizes,
    capture_batches,
    free_memory,
    greedy,
    profiled_step,
    random_prompts,
    sync,
)
from benchmarks.gpu_check_parts import big_model, hf_generate, load_hf

GIB = 2**30
MEMORY_NOTES: dict[str, Any] = {}  # what section 3's engine saw of memory, reported by section 4


def _gib(n: int | float) -> float:
    return round(n / GIB, 3)


# ----------------------------------------------------------------------------- section 3


def timed(fn: Any, device: str) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def hf_sweep(model: Any, prompts: list[list[int]], sizes: Sizes, batches: list[int]) -> dict[str, Any]:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    rows = {}
    for bs in batches:

        def run(bs: int = bs) -> None:
            for b in range(0, len(order), bs):
                hf_generate(model, [prompts[i] for i in order[b : b + bs]], sizes.out_tokens, sizes.device)

        _, seconds = timed(run, sizes.device)
        rows[bs] = {"seconds": round(seconds, 2), "output_tok_s": round(len(prompts) * sizes.out_tokens / seconds, 1)}
    best = max(rows, key=lambda b: rows[b]["output_tok_s"])
    return {"by_batch_size": rows, "best_batch_size": best, **rows[best]}


def engine_run(llm: LLM, prompts: list[list[int]], sizes: Sizes) -> dict[str, Any]:
    llm.generate([[5, 6, 7, 8]] * 2, greedy(4))  # warm-up
    before = llm.stats
    if sizes.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    outs, seconds = timed(lambda: llm.generate(prompts, greedy(sizes.out_tokens)), sizes.device)
    delta = {k: v - before[k] for k, v in llm.stats.items()}
    produced = sum(o.num_output_tokens for o in outs)
    return {"seconds": round(seconds, 2), "output_tok_s": round(produced / seconds, 1), "stats": delta}


@contextlib.contextmanager
def timers(llm: LLM, device: str) -> Iterator[dict[str, float]]:
    """Wall time per phase of engine.step (a CUDA sync closes each phase, so the split is honest)."""
    totals = {"schedule": 0.0, "execute": 0.0, "metadata": 0.0, "sampler": 0.0, "stop_checks": 0.0}
    patches = [
        (llm.engine.scheduler, "schedule", "schedule"),
        (llm.engine.runner, "execute", "execute"),
        (llm.engine.runner.backend, "plan", "metadata"),
        (Sampler, "__call__", "sampler"),
        (StopChecker, "append", "stop_checks"),
    ]
    saved = []
    for owner, name, label in patches:
        real = getattr(owner, name)
        saved.append((owner, name, owner.__dict__.get(name, real) if isinstance(owner, type) else real))

        def wrapper(*args: Any, _real: Any = real, _label: str = label, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = _real(*args, **kwargs)
            sync(device)
            totals[_label] += time.perf_counter() - start
            return out

        setattr(owner, name, wrapper)
    try:
        yield totals
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)


def breakdown(llm: LLM, sizes: Sizes) -> dict[str, Any]:
    vocab = sizes.big["vocab_size"]
    for p in random_prompts(sizes.breakdown_prompts, sizes.prompt_lens, vocab, seed=5):
        llm.engine.add_request(p, greedy(sizes.out_tokens))
    with capture_batches(llm) as seen:
        while any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.engine.scheduler.running) or (
            llm.engine.scheduler.num_waiting
        ):
            llm.engine.step()
    stats0 = llm.stats
    decode_steps = 0
    with timers(llm, sizes.device) as totals:
        start = time.perf_counter()
        for _ in range(min(16, sizes.out_tokens - 3)):
            llm.engine.step()
            decode_steps += 1
        total = time.perf_counter() - start
    profiled = [profiled_step(llm, sizes.device) for _ in range(2)]
    counters = {k: v - stats0.get(k, 0) for k, v in llm.stats.items() if "sync" in k or "transfer" in k}
    while llm.engine.has_unfinished():
        llm.engine.step()
    ms = {k: round(v / decode_steps * 1e3, 3) for k, v in totals.items()}
    ms["forward"] = round(ms["execute"] - ms["metadata"], 3)
    ms["step_total"] = round(total / decode_steps * 1e3, 3)
    return {
        "decode_batch": sizes.breakdown_prompts,
        "prefill_steps": len(seen),
        "decode_step_ms": ms,
        "profiled_decode_shapes": [p[0] for p in profiled],
        "sync_calls_per_decode_step_profiler": {k: profiled[-1][2].get(k, 0) for k in SYNC_CALLS},
        "memcpy_calls_per_decode_step_profiler": profiled[-1][2].get("cudaMemcpyAsync", 0),
        "sync_counters_per_decode_step": {k: v / decode_steps for k, v in counters.items()} or None,
        "sync_counters_note": None if counters else "this build's EngineStats has no sync/transfer counter",
    }


def section3(sizes: Sizes, work: Path) -> dict[str, Any]:
    path = big_model(sizes, work)
    vocab = sizes.big["vocab_size"]
    prompts = random_prompts(sizes.n_prompts, sizes.prompt_lens, vocab, seed=3)
    prefix = random_prompts(1, (sizes.shared_prefix, sizes.shared_prefix), vocab, seed=4)[0]
    shared = random_prompts(sizes.n_prompts, (sizes.prompt_lens[0] // 4, sizes.prompt_lens[0]), vocab, 6, prefix)
    model = load_hf(path, sizes.device, torch.bfloat16)
    hf_generate(model, prompts[:2], 2, sizes.device)  # warm-up
    hf = hf_sweep(model, prompts, sizes, sizes.hf_batches)
    hf_shared = hf_sweep(model, shared, sizes, [hf["best_batch_size"]])
    del model
    free_memory()
    free_before = torch.cuda.mem_get_info() if sizes.device == "cuda" else None
    llm = LLM(str(path), device=sizes.device, dtype="bfloat16", **sizes.engine)
    runner = llm.engine.runner
    native = engine_run(llm, prompts, sizes)
    MEMORY_NOTES.update(
        free_before_gib=None if free_before is None else _gib(free_before[0]),
        pool_gib=_gib(sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)),
        pool_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        profile=None if llm.memory_profile is None else {k: v for k, v in vars(llm.memory_profile).items()},
        peak_allocated_gib=_gib(torch.cuda.max_memory_allocated()) if sizes.device == "cuda" else None,
    )
    native_shared = engine_run(llm, shared, sizes)
    steps = breakdown(llm, sizes)
    config = {k: getattr(llm.config, k) for k in ("block_size", "max_num_seqs", "max_num_batched_tokens")}
    attention = runner.attention.path
    del llm, runner
    free_memory()
    llm = LLM(str(path), device=sizes.device, dtype="bfloat16", enable_prefix_caching=False, **sizes.engine)
    native_shared_off = engine_run(llm, shared, sizes)
    del llm
    free_memory()
    small_blocks = None
    if config["block_size"] != 16:  # what the varlen kernel's 256-token blocks cost the prefix cache
        llm = LLM(str(path), device=sizes.device, dtype="bfloat16", block_size=16, **sizes.engine)
        small_blocks = engine_run(llm, shared, sizes) | {"attention": llm.engine.runner.attention.path}
        del llm
        free_memory()
    return {
        "workload": f"{len(prompts)} prompts of {sizes.prompt_lens} tokens, {sizes.out_tokens} output tokens each",
        "engine_config": config,
        "attention": attention,
        "hf_generate_bf16": hf,
        "native_bf16": native,
        "native_over_hf_best": round(native["output_tok_s"] / hf["output_tok_s"], 2),
        "shared_prefix": {
            "workload": f"{sizes.shared_prefix}-token shared preamble + own tokens",
            "hf_generate_bf16": hf_shared,
            "native_caching_on": native_shared,
            "native_caching_off": native_shared_off,
            "native_caching_on_block16": small_blocks,
            "native_on_over_hf": round(native_shared["output_tok_s"] / hf_shared["output_tok_s"], 2),
        },
        "per_step": steps,
    }


# ----------------------------------------------------------------------------- section 4


def long_chunk(path: Path, sizes: Sizes, block: int | None) -> dict[str, Any]:
    """One prompt of sizes.long_chunk tokens: its second chunk attends over a whole budget of context."""
    vocab = sizes.big["vocab_size"]
    llm = LLM(
        str(path),
        device=sizes.device,
        dtype="bfloat16",
        block_size=block,
        max_model_len=sizes.long_chunk + 8,
        **sizes.engine,
    )
    cuda = sizes.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    resting = torch.cuda.memory_allocated() if cuda else 0
    with capture_batches(llm) as seen:
        llm.generate(random_prompts(1, (sizes.long_chunk, sizes.long_chunk), vocab, seed=11), greedy(1))
    peak = torch.cuda.max_memory_allocated() - resting if cuda else None
    runner = llm.engine.runner
    result = {
        "block_size": runner.block_size,
        "attention": runner.attention.path,
        "chunks": [[c.start, c.num_tokens] for b in seen for c in b.chunks],
        "peak_above_resting_gib": None if peak is None else _gib(peak),
    }
    del llm, runner
    free_memory()
    return result


def section4(sizes: Sizes, work: Path) -> dict[str, Any]:
    path = big_model(sizes, work)
    chunks = [long_chunk(path, sizes, None)]
    if chunks[0]["block_size"] != 16:
        chunks.append(long_chunk(path, sizes, 16))
    total = torch.cuda.mem_get_info()[1] if sizes.device == "cuda" else None
    return {
        "total_gib": None if total is None else _gib(total),
        "section3_engine": dict(MEMORY_NOTES) or None,
        "worst_case_long_chunk": chunks,
        "note": None if sizes.device == "cuda" else "CPU run: device memory figures are CUDA-only (null)",
    }


# ----------------------------------------------------------------------------- section 5


def section5(sizes: Sizes, work: Path, hf_tok_s: float | None) -> dict[str, Any]:
    """Section 3's main workload with `compile=True` and 16-token blocks, so that on CUDA decode-only
    steps replay CUDA graphs whichever attention path the default block size would pick. Last of
    all: a CUDA error here can poison the process's CUDA context, which no try/except contains.
    Compiling and the first capture of each (rows, width) graph fall inside the timed run."""
    path = big_model(sizes, work)
    prompts = random_prompts(sizes.n_prompts, sizes.prompt_lens, sizes.big["vocab_size"], seed=3)  # section 3's
    engine = {**sizes.engine, "block_size": 16}
    llm = LLM(str(path), device=sizes.device, dtype="bfloat16", compile=True, **engine)
    result = engine_run(llm, prompts, sizes)
    runner = llm.engine.runner
    result |= runner.forward.stats.as_dict()
    result["compiled"] = runner.forward.compile  # still on after the run (no fallback to eager)
    result["cuda_graphs_captured"] = None if runner.graphs is None else runner.graphs.num_graphs
    result["attention"] = runner.attention.path
    result["compiled_over_hf_best"] = None if not hf_tok_s else round(result["output_tok_s"] / hf_tok_s, 2)
    del llm, runner
    free_memory()
    return result
