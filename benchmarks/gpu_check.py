"""The prepared GPU check: one script, at most 6 minutes on one H200, no downloads, JSON after each section.

    python benchmarks/gpu_check.py --out gpu_check.json                 # on a CUDA machine
    python benchmarks/gpu_check.py --sections parity,throughput         # some sections only
    python benchmarks/gpu_check.py --smoke --out smoke.json             # tiny sizes on the CPU (a test runs it)

Sections, in this order (each records its own error and the next one still runs):
  env         versions, the GPU, the attention path and backend per setting, and which kernels
              each call shape (prefill, continuation chunk, decode, mixed) launches (torch profiler)
  parity      float32 greedy tokens of the eager engine (torch backend) == transformers `generate`
              (eager attention: its default sdpa drops Gemma 2's soft-capping), nine tiny architectures,
              under pressure (chunked prefill, prefix caching, preemption) and relaxed
  triton      the same with attention_backend "triton", against transformers and the eager engine;
              "skipped: attention_backend 'triton' not available: <the engine's reason>" where refused
  compiled    the compiled forward (engine.compile true, CUDA graphs held off) under pressure, same
              comparisons (gemma2, llama)
  graphs      CUDA-graph decode steps (compiled; a pool where every decode-only step fits a graph),
              same comparisons; fails if no step replayed a graph
  syncs       per decode step, for each sampling feature, eager and compiled + graphs: the engine's
              own counts (Transfers' reads and uploads, recompiles, captures, replays) beside the
              profiler's synchronize calls; the script's own syncs are counted apart, never as the engine's
  throughput  a 1.24B Llama-3.2-1B-shaped bf16 model (random weights, saved in bf16): transformers
              `generate` at batch sizes 64/128/256 vs the engine eager and compiled (+ graphs), one process,
              output tokens/s and the ratio; a shared-prefix variant; bf16 greedy agreement; memory. Each
              engine run is timed after a warm-up of the same shapes (other tokens), and the section
              fails if the engine counts a recompile or a graph capture inside the timed run
Status per section: ok, failed (a check failed: "failures" says which), error (an exception),
skipped (why), or cut (the budget ran out: "cut" lists what was left out). Exit code 1 when any
section failed or raised. Warnings and library log lines are printed once per kind and counted
in the JSON ("warnings").

Time (H200). Every section has a budget; past it a section skips its remaining optional parts
(architectures, batch sizes, variants) and lists them under "cut", and no section starts after
the 6-minute cap (each gets at most what is left of it). The estimate per section and how it was
made is ESTIMATE_NOTES below; the CPU smoke's per-part seconds it starts from are in the smoke's
JSON ("seconds" of each section, compile seconds, load and warm-up seconds of each engine run).

Imports only torch, transformers (and its tokenizers), triton where present, and batchgen.engine:
what the GPU image has (no pydantic, ray or xgrammar; the smoke test blocks them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()  # the hard cap counts from here: imports and CUDA's start-up are part of the run
if "--smoke" in sys.argv:  # why before torch: the Triton backend runs on the CPU only in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
# why: the profiler's library prints two lines per profiled window (start/stop) at every level below 6;
# the sections check that the profiler saw CUDA activity instead of relying on its error lines
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.gpu_check_common import Budget, Ctx, Report, Sizes, start_watchdog  # noqa: E402
from benchmarks.gpu_check_quiet import OWN_LOGGER, Quiet  # noqa: E402

log = logging.getLogger(OWN_LOGGER)

BIG_1B = dict(  # Llama-3.2-1B's shape: ~1.24B parameters
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
ALL_ARCHS = ["llama", "gemma2", "mistral", "qwen2", "gemma3", "gpt2", "qwen3", "phi3", "gpt_neox"]  # by coverage
SECTION_NAMES = ["env", "parity", "triton", "compiled", "graphs", "syncs", "throughput"]

ESTIMATE_NOTES = """(filled in from the smoke's measured parts)"""

FULL = Sizes(
    device="cuda",
    archs=ALL_ARCHS,
    triton_archs=ALL_ARCHS,
    triton_settings=["pressure", "relaxed"],
    compiled_archs=["gemma2", "llama"],  # gemma2 first: soft-capping, sliding window and GQA at once
    compiled_setting="pressure",  # preemption (a pool too small for decode graphs: bucket x 16 blocks)
    graphs_setting="graphs",
    parity_prompts=24,
    parity_settings=["pressure", "relaxed"],
    big=BIG_1B,
    big_dtype="bfloat16",
    n_prompts=256,
    prompt_lens=(256, 768),
    out_tokens=128,
    hf_batches=[256, 128, 64],
    shared_prefix=400,
    sync_requests=8,
    sync_steps=8,
    estimate_s={
        "env": 10,
        "parity": 40,
        "triton": 45,
        "compiled": 40,
        "graphs": 20,
        "throughput": 150,
        "throughput.compiled": 90,
        "syncs": 20,
    },
    budget_s={"env": 15, "parity": 50, "triton": 50, "compiled": 50, "graphs": 25, "throughput": 150, "syncs": 20},
    total_cap_s=330,
    hard_cap_s=360,
)
SMOKE = Sizes(
    device="cpu",
    archs=["llama", "gemma2"],  # gemma2: soft-capping, checked against transformers' eager attention
    triton_archs=["llama"],  # the Triton interpreter runs every program instance in Python: slow
    triton_settings=["pressure"],
    compiled_archs=["llama"],
    compiled_setting="graphs",  # why one setting: one compile for both sections (tests/engine covers pressure)
    graphs_setting="graphs",
    parity_prompts=3,
    # the tiny parity Llama's graph in float32: the compiled variant reuses the compiled sections' work
    big=dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    big_dtype="float32",
    parity_settings=["pressure", "relaxed"],
    n_prompts=6,
    prompt_lens=(16, 40),
    out_tokens=5,
    hf_batches=[6],
    shared_prefix=24,
    sync_requests=3,
    sync_steps=2,
    estimate_s={
        "env": 5,
        "parity": 8,
        "triton": 10,
        "compiled": 15,
        "graphs": 5,
        "throughput": 20,
        "throughput.compiled": 10,
        "syncs": 10,
    },
    # why generous: on a busy CI machine a cut would hide the code it is there to keep alive
    budget_s=dict.fromkeys(SECTION_NAMES, 600.0),
    total_cap_s=3600,
    hard_cap_s=3600,
    engine={"max_num_batched_tokens": 96, "max_num_seqs": 8},
    graph_backend="torch",
    graph_standin=True,
)


def section_functions() -> dict[str, Callable[[Ctx, dict[str, Any]], None]]:
    from benchmarks import gpu_check_compiled as compiled
    from benchmarks import gpu_check_env as env
    from benchmarks import gpu_check_parity as parity
    from benchmarks import gpu_check_perf as perf
    from benchmarks import gpu_check_syncs as syncs

    return {
        "env": env.run,
        "parity": parity.section_parity,
        "triton": parity.section_triton,
        "compiled": compiled.section_compiled,
        "graphs": compiled.section_graphs,
        "throughput": perf.section_throughput,
        "syncs": syncs.section_syncs,
    }


def status_of(out: dict[str, Any]) -> str:
    if "error" in out:
        return "error"
    if out.get("failures"):
        return "failed"
    if "skipped" in out:
        return "skipped"
    return "cut" if out.get("cut") else "ok"


def run_section(ctx: Ctx, name: str, fn: Callable[[Ctx, dict[str, Any]], None], seconds: float) -> None:
    """Run one section under its budget; what it recorded before an exception is kept."""
    out: dict[str, Any] = {"budget_s": round(seconds, 1)}
    ctx.report.data[name] = out
    ctx.budget = Budget(seconds)
    try:
        fn(ctx, out)
    except Exception as exc:  # why: one failing section must not cost the others' figures
        log.exception("section %s raised", name)
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()[-4000:]
    out["seconds"] = round(ctx.budget.spent(), 1)
    out["status"] = status_of(out)
    ctx.save()


def plan(sizes: Sizes, names: list[str]) -> dict[str, Any]:
    return {
        "sections": names,
        "estimate_s": {n: sizes.estimate_s[n] for n in names},
        "budget_s": {n: sizes.budget_s[n] for n in names},
        "estimate_total_s": sum(sizes.estimate_s[n] for n in names),
        "no_section_starts_after_s": sizes.total_cap_s,
        "hard_cap_s": sizes.hard_cap_s,
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU, for the test that keeps this alive"
    )
    parser.add_argument("--sections", default=",".join(SECTION_NAMES), help="comma-separated, from: %(default)s")
    args = parser.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTION_NAMES]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; known: {', '.join(SECTION_NAMES)}")
    args.sections = [s for s in SECTION_NAMES if s in args.sections]  # why: the order above, always
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    quiet = Quiet()
    quiet.install()
    sizes = SMOKE if args.smoke else FULL
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; use --smoke for the CPU run", file=sys.stderr)
        return 2
    report = Report(args.out)
    report.data.update(mode="smoke" if args.smoke else "full", plan=plan(sizes, args.sections))
    p = report.data["plan"]
    log.info(
        "sections %s", ", ".join(f"{n} ~{p['estimate_s'][n]:.0f}s (cap {p['budget_s'][n]:.0f}s)" for n in p["sections"])
    )
    log.info(
        "estimate %.0f s in all; no section starts after %.0f s; stopped at %.0f s whatever it is doing",
        p["estimate_total_s"],
        p["no_section_starts_after_s"],
        p["hard_cap_s"],
    )
    report.write()
    functions = section_functions()
    running: list[str | None] = [None]  # the section in progress, for the watchdog
    start_watchdog(report, STARTED, sizes.hard_cap_s, lambda: running[0])
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = Ctx(sizes, Path(tmp), report)
        for name in args.sections:
            left = sizes.total_cap_s - (time.perf_counter() - STARTED)
            if left <= 0:
                report.data[name] = {"status": "skipped", "skipped": "the run's time cap was spent"}
                continue
            running[0] = name
            run_section(ctx, name, functions[name], min(sizes.budget_s[name], left))
            running[0] = None
            report.data["warnings"] = quiet.summary()
            out = report.data[name]
            log.info("section %s: %s in %.1f s %s", name, out["status"], out["seconds"], out.get("failures", ""))
        report.data["script_syncs"] = ctx.script_syncs
    report.data["seconds"] = round(time.perf_counter() - STARTED, 1)
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.data["warnings"] = quiet.summary()
    report.write()
    statuses = {n: report.data[n]["status"] for n in args.sections}
    print(json.dumps({"seconds": report.data["seconds"], **statuses}))
    return 1 if any(s in ("failed", "error") for s in statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
