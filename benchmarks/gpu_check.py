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
  bf16        the engine in bf16 vs transformers in bf16 (what `dtype: auto` runs on CUDA) under the
              reduced-precision policy of testkit/precision_policy (as tests/engine/test_bf16_parity.py
              on the CPU): prompt logprobs teacher-forced, greedy tokens up to transformers' first near-tie
  triton      the parity check with attention_backend "triton", against transformers and the eager engine;
              "skipped: attention_backend 'triton' not available: <the engine's reason>" where refused
  compiled    the compiled forward (engine.compile true, CUDA graphs held off) under pressure, same
              comparisons (gemma2, llama)
  graphs      CUDA-graph decode steps (compiled; a pool where every decode-only step fits a graph),
              same comparisons; fails if no step replayed a graph
  syncs       per decode step, for each sampling feature, eager and compiled + graphs: the engine's
              own counts (Transfers' reads and uploads, recompiles, captures, replays) beside the
              profiler's synchronize calls; the script's own syncs are counted apart, never as the engine's
  throughput  a 1.24B Llama-3.2-1B-shaped bf16 model (random weights, saved in bf16): transformers
              `generate` at batch sizes 128/256 vs the engine eager and compiled (+ graphs), one process,
              output tokens/s and the ratio; a shared-prefix variant; bf16 greedy agreement; memory. Each
              engine run is timed after a warm-up of the same shapes (other tokens), and the section
              fails if the engine counts a recompile or a graph capture inside the timed run

Status per section: ok, failed (a check failed: "failures" says which), error (an exception),
skipped (why), or cut (the budget ran out: "cut" lists what was left out). Exit code 1 when any
section failed or raised. Warnings and library log lines are printed once per kind and counted
in the JSON ("warnings").

Time (H200): about 5.3 minutes estimated, the tp section's 25 s only with 2+ GPUs (gpu_check_sizes.py
says how: from CPU measurements of its parts at the full counts). Each section has a budget; past it
a section skips its remaining optional parts (architectures, batch sizes, variants) and lists them
under "cut". A section's budget never eats into the estimates of the sections after it, no section
starts after 330 s, and a watchdog ends the run at 360 s, writing the report with the running
section marked cut (exit code 3). The plan
(estimates, budgets, caps) is printed up front and is the JSON's "plan".

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
from benchmarks.gpu_check_sizes import FULL, SECTION_NAMES, SMOKE, for_gpus  # noqa: E402

log = logging.getLogger(OWN_LOGGER)


def section_functions() -> dict[str, Callable[[Ctx, dict[str, Any]], None]]:
    from benchmarks import gpu_check_bf16 as bf16
    from benchmarks import gpu_check_compiled as compiled
    from benchmarks import gpu_check_env as env
    from benchmarks import gpu_check_parity as parity
    from benchmarks import gpu_check_perf as perf
    from benchmarks import gpu_check_syncs as syncs
    from benchmarks import gpu_check_tp as tp

    return {
        "env": env.run,
        "parity": parity.section_parity,
        "bf16": bf16.section_bf16,
        "triton": parity.section_triton,
        "compiled": compiled.section_compiled,
        "graphs": compiled.section_graphs,
        "throughput": perf.section_throughput,
        "syncs": syncs.section_syncs,
        "tp": tp.section_tp,
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


def section_time(sizes: Sizes, names: list[str], elapsed: float) -> float:
    """Seconds the section names[0] may take: its budget, less whatever would eat into the estimates
    of the sections after it before the cap, but at least half its own estimate (within the cap).

    Why reserve: the last section (throughput, the headline figure) must not be starved by earlier
    ones running up to their budgets; what a section leaves unused flows on to the next."""
    name, left = names[0], sizes.total_cap_s - elapsed
    room = left - sum(sizes.estimate_s[n] for n in names[1:])
    return min(sizes.budget_s[name], max(room, min(0.5 * sizes.estimate_s[name], left)))


def plan(sizes: Sizes, names: list[str]) -> dict[str, Any]:
    return {
        "sections": names,
        "estimate_s": {n: sizes.estimate_s[n] for n in names},
        "budget_s": {n: sizes.budget_s[n] for n in names},
        "estimate_total_s": sum(sizes.estimate_s[n] for n in names),
        "no_section_starts_after_s": sizes.total_cap_s,
        "hard_cap_s": sizes.hard_cap_s,
    }


def announce(p: dict[str, Any]) -> None:
    """The plan, up front: what a cut-off run's JSON will be measured against."""
    log.info(
        "sections %s", ", ".join(f"{n} ~{p['estimate_s'][n]:.0f}s (cap {p['budget_s'][n]:.0f}s)" for n in p["sections"])
    )
    log.info(
        "estimate %.0f s in all; no section starts after %.0f s; stopped at %.0f s whatever it is doing",
        p["estimate_total_s"],
        p["no_section_starts_after_s"],
        p["hard_cap_s"],
    )


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
    sizes = SMOKE if args.smoke else for_gpus(FULL, torch.cuda.device_count())
    if args.smoke:  # why: tiny models gain nothing from a second thread, and on a busy machine OpenMP's
        torch.set_num_threads(1)  # spinning threads made transformers' generate 20x slower (measured)
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; use --smoke for the CPU run", file=sys.stderr)
        return 2
    report = Report(args.out)
    report.data.update(mode="smoke" if args.smoke else "full", plan=plan(sizes, args.sections))
    announce(report.data["plan"])
    report.write()
    functions = section_functions()
    running: list[str | None] = [None]  # the section in progress, for the watchdog
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        watchdog = start_watchdog(report, STARTED, sizes.hard_cap_s, lambda: running[0], Path(tmp))
        ctx = Ctx(sizes, Path(tmp), report)
        for i, name in enumerate(args.sections):
            elapsed = time.perf_counter() - STARTED
            if elapsed >= sizes.total_cap_s:
                report.data[name] = {"status": "skipped", "skipped": "the run's time cap was spent"}
                continue
            running[0] = name
            run_section(ctx, name, functions[name], section_time(sizes, args.sections[i:], elapsed))
            running[0] = None
            report.data["warnings"] = quiet.summary()
            out = report.data[name]
            log.info("section %s: %s in %.1f s %s", name, out["status"], out["seconds"], out.get("failures", ""))
        report.data["script_syncs"] = ctx.script_syncs
        watchdog.set()
    report.data["seconds"] = round(time.perf_counter() - STARTED, 1)
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.data["warnings"] = quiet.summary()
    report.write()
    statuses = {n: report.data[n]["status"] for n in args.sections}
    print(json.dumps({"seconds": report.data["seconds"], **statuses}))
    return 1 if any(s in ("failed", "error") for s in statuses.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
