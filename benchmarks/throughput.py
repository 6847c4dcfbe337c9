"""Side-by-side throughput: batchgen's engine vs transformers `generate` and `generate_batch`, one run.

    .venv/bin/python benchmarks/throughput.py                 # full run, JSON on stdout
    .venv/bin/python benchmarks/throughput.py --quick         # small sizes, a few minutes
    .venv/bin/python benchmarks/throughput.py --markdown      # also rewrite the table in RESULTS.md
    .venv/bin/python benchmarks/throughput.py --contended     # one busy process per core beside the run
    .venv/bin/python benchmarks/throughput.py --sweep         # the shape sweep (benchmarks/sweep.py)

Same models, prompts and machine for every system, and one process for every system of a model
(each model's section runs in a process of its own, see _model_in_own_process); greedy everywhere. For each model
(the demo model and a random ~57M Llama) and workload (a: mixed lengths, b: shared prefix,
c: the sample dataset with stop strings) it reports output and total tokens/s, prefill tokens
computed, preemptions, peak RSS, the ratios the issue targets, greedy agreement on (a), and a
decode step of the engine against the raw model forward of the same batch, with a breakdown.
Absolute numbers on a shared machine are noise; the ratios, measured in one run, are the figure.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

from benchmarks import bench_models, decode_floor, results_md, sweep, systems, workloads
from benchmarks.busy import busy_neighbours
from benchmarks.systems import RunResult

log = logging.getLogger("throughput")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["demo", "large"], choices=["demo", "large"])
    p.add_argument("--workloads", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    p.add_argument("--requests", type=int, default=None, help="requests per workload (default 64, --quick 16)")
    p.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="static batch sizes swept for transformers generate (default 8 16 32 64)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (one core each)")
    p.add_argument("--decode-steps", type=int, default=None, help="decode steps timed for the floor (default 20)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="runs of each side of a headline ratio, fastest kept (default 2, --quick 1)",
    )
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run (not for the table)")
    p.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run (a) with both sides in bfloat16 (default on)",
    )
    p.add_argument(
        "--markdown",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rewrite the results table in benchmarks/RESULTS.md",
    )
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument(
        "--contended", action="store_true", help="one busy process per core beside the whole run (both sides alike)"
    )
    p.add_argument(
        "--sweep", action="store_true", help="the shape sweep instead (benchmarks/sweep.py; --quick, --contended apply)"
    )
    p.add_argument(
        "--one-process",
        action="store_true",
        help="run every model in this process (default: each model's section in a process of its own)",
    )
    args = p.parse_args(argv)
    args.requests = args.requests or (16 if args.quick else 64)
    args.batch_sizes = args.batch_sizes or ([8, 16] if args.quick else [8, 16, 32, 64])
    args.decode_steps = args.decode_steps or (8 if args.quick else 20)
    args.repeats = args.repeats or (1 if args.quick else 2)
    return args


def figures(r: RunResult) -> dict[str, Any]:
    """One system's row: throughput from the tokens the requests asked for, over the timed region."""
    return {
        "seconds": round(r.seconds, 3),
        "output_tokens": r.output_tokens,
        "prompt_tokens": r.prompt_tokens,
        "output_tok_s": round(r.output_tokens / r.seconds, 1),
        "total_tok_s": round((r.output_tokens + r.prompt_tokens) / r.seconds, 1),
        "prefill_tokens": r.prefill_tokens,
        "preemptions": r.preemptions,
        "peak_rss_mib": round(r.peak_rss_mib, 1),
        "cpu_wait_share": r.cpu_wait,
        **r.extra,
    }


def agreement(native: RunResult, other: RunResult) -> dict[str, Any]:
    """Greedy agreement: requests whose tokens match exactly, and the share of matching leading tokens."""
    same = sum(a == b for a, b in zip(native.outputs, other.outputs))
    prefix = total = 0
    for a, b in zip(native.outputs, other.outputs):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix, total = prefix + n, total + len(a)
    return {
        "against": other.system,
        "identical_requests": same,
        "requests": len(native.outputs),
        "leading_tokens_matching": round(prefix / max(total, 1), 4),
    }


def _ratio(a: RunResult, b: RunResult) -> float:
    return round((a.output_tokens / a.seconds) / (b.output_tokens / b.seconds), 3)


def best_of(runs: list[RunResult]) -> RunResult:
    """The fastest of repeated runs of one system; every time is kept in its row."""
    best = min(runs, key=lambda r: r.seconds)
    best.extra["seconds_all"] = [round(r.seconds, 3) for r in runs]
    # why the largest: only a process's first engine of a model compiles; later ones reuse its code
    for key in ("compile_seconds", "compiled_graphs"):
        if any(key in r.extra for r in runs):
            best.extra[key] = max(r.extra.get(key, 0) for r in runs)
    return best


def run_mixed(
    model: bench_models.BenchModel, wl: workloads.Workload, args: argparse.Namespace, hf: tuple[Any, Any]
) -> dict[str, Any]:
    """(a): native, generate at every batch size, generate_batch; ratios and agreement.

    Native and the best static batch size both run `--repeats` times and keep their fastest
    run (the same treatment for both sides of the headline ratio, against machine noise).
    """
    native = best_of([systems.run_native(model.path, wl) for _ in range(args.repeats)])
    log.info("%s a native %s %s", model.name, native.extra["seconds_all"], native.extra.get("compile_seconds"))
    # why an eager row: on the CPU the default compiles (engine.compile auto), so this shows what it buys
    eager = best_of(
        [systems.run_native(model.path, wl, compile=False, name="native_eager") for _ in range(args.repeats)]
    )
    log.info("%s a native_eager %s", model.name, eager.extra["seconds_all"])
    sweep = []
    for bs in args.batch_sizes:
        sweep.append(systems.run_hf_generate(*hf, wl, bs))
        log.info("%s a generate bs=%d %.1fs", model.name, bs, sweep[-1].seconds)
    best = min(sweep, key=lambda r: r.seconds / max(r.output_tokens, 1))
    again = [systems.run_hf_generate(*hf, wl, best.extra["batch_size"]) for _ in range(args.repeats - 1)]
    best = best_of([best, *again])
    sweep = [best if r.system == best.system else r for r in sweep]
    cb = systems.run_hf_generate_batch(*hf, wl)
    log.info("%s a generate best %s, generate_batch %.1fs", model.name, best.extra["seconds_all"], cb.seconds)
    res = {
        "description": wl.description,
        "systems": {r.system: figures(r) for r in [native, eager, *sweep, cb]},
        "best_static_batch_size": best.extra["batch_size"],
        "ratios": {
            "native_over_hf_generate_best": _ratio(native, best),
            "native_over_hf_generate_batch": _ratio(native, cb),
            "compiled_over_eager": _ratio(native, eager),
        },
        "greedy_agreement": [agreement(native, best), agreement(native, cb), agreement(eager, native)],
    }
    if args.bf16:
        run_bf16(model, wl, args, best.extra["batch_size"], native, res)
    return res


def run_bf16(
    model: bench_models.BenchModel,
    wl: workloads.Workload,
    args: argparse.Namespace,
    batch_size: int,
    native_fp32: RunResult,
    res: dict[str, Any],
) -> None:
    """(a) with both sides in bfloat16: native (compile as by default) vs generate at (a)'s best batch size."""
    native = best_of(
        [systems.run_native(model.path, wl, dtype="bfloat16", name="native_bf16") for _ in range(args.repeats)]
    )
    hf = systems.load_hf(model.path, torch.bfloat16)
    static = best_of([systems.run_hf_generate(*hf, wl, batch_size) for _ in range(args.repeats)])
    static.system = f"hf_generate_bf16_bs{batch_size}"
    log.info("%s a bf16 native %s generate %s", model.name, native.extra["seconds_all"], static.extra["seconds_all"])
    res["systems"].update({r.system: figures(r) for r in (native, static)})
    res["ratios"]["bf16_native_over_hf_generate_bf16"] = _ratio(native, static)
    res["ratios"]["bf16_native_over_fp32_native"] = _ratio(native, native_fp32)
    res["greedy_agreement"] += [agreement(native, static), agreement(native, native_fp32)]


def run_prefix(model: bench_models.BenchModel, wl: workloads.Workload, repeats: int) -> dict[str, Any]:
    """(b): the same engine with prefix caching on and off, each the fastest of `repeats` runs."""
    on = best_of(
        [systems.run_native(model.path, wl, prefix_caching=True, name="native_prefix_cache_on") for _ in range(repeats)]
    )
    off = best_of(
        [
            systems.run_native(model.path, wl, prefix_caching=False, name="native_prefix_cache_off")
            for _ in range(repeats)
        ]
    )
    log.info("%s b on %s off %s", model.name, on.extra["seconds_all"], off.extra["seconds_all"])
    return {
        "description": wl.description,
        "systems": {r.system: figures(r) for r in (on, off)},
        "ratios": {"prefix_on_over_off": round(off.seconds / on.seconds, 3)},
    }


def run_sample(
    model: bench_models.BenchModel, wl: workloads.Workload, batch_size: int, hf: tuple[Any, Any]
) -> dict[str, Any]:
    """(c): native vs generate (the best batch size of (a)) and generate_batch, with stop strings."""
    native = systems.run_native(model.path, wl)
    static = systems.run_hf_generate(*hf, wl, batch_size)
    cb = systems.run_hf_generate_batch(*hf, wl)
    log.info(
        "%s c native %.1fs generate %.1fs generate_batch %.1fs", model.name, native.seconds, static.seconds, cb.seconds
    )
    return {
        "description": wl.description + f"; generate at the best batch size of (a), {batch_size}",
        "systems": {r.system: figures(r) for r in (native, static, cb)},
        "ratios": {
            "native_over_hf_generate": _ratio(native, static),
            "native_over_hf_generate_batch": _ratio(native, cb),
        },
        "greedy_agreement": [agreement(native, static), agreement(native, cb)],
    }


def run_model(model: bench_models.BenchModel, args: argparse.Namespace) -> dict[str, Any]:
    hf = systems.load_hf(model.path)
    vocab, eos = hf[0].config.vocab_size, hf[0].generation_config.eos_token_id
    special = {eos} if isinstance(eos, int) else set(eos or [])
    out: dict[str, Any] = {
        "description": model.description,
        "params": model.params,
        "standin": model.standin,
        "workloads": {},
    }
    best_bs = args.batch_sizes[-1]
    if "a" in args.workloads:
        max_out = 64 if args.quick else 256
        res = run_mixed(model, workloads.mixed(args.requests, vocab, special, max_out=max_out), args, hf)
        out["workloads"]["a_mixed"], best_bs = res, res["best_static_batch_size"]
    if "b" in args.workloads:
        wl = workloads.shared_prefix(args.requests, vocab, special)
        out["workloads"]["b_shared_prefix"] = run_prefix(model, wl, args.repeats)
    if "c" in args.workloads:
        wl = workloads.sample_dataset(args.requests, hf[1])
        out["workloads"]["c_sample"] = (
            run_sample(model, wl, best_bs, hf)
            if wl is not None
            else {"skipped": "sample_data/prompts.parquet is not there yet"}
        )
    out["decode_step"] = decode_floor.measure(model.path, batch=64, context=256, steps=args.decode_steps)
    log.info("%s decode step/raw %.3f", model.name, out["decode_step"]["step_over_raw"])
    return out


def targets(models: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured ratio and whether it is met."""
    rows = []

    def row(target: str, measured: float, met: bool) -> None:
        rows.append({"target": target, "measured": measured, "met": met})

    for name, res in models.items():
        a = res["workloads"].get("a_mixed")
        if a:
            for key in ("native_over_hf_generate_best", "native_over_hf_generate_batch"):
                row(f"{name} (a) {key} >= 3", a["ratios"][key], a["ratios"][key] >= 3.0)
        b = res["workloads"].get("b_shared_prefix")
        if b:
            goal = 2.5 if name == "demo" else 2.0
            ratio = b["ratios"]["prefix_on_over_off"]
            row(f"{name} (b) prefix_on_over_off >= {goal}", ratio, ratio >= goal)
        ratio = res["decode_step"]["step_over_raw"]
        row(f"{name} decode step / raw forward <= 0.5", ratio, ratio <= 0.5)
    return rows


def cpu_name() -> str:
    from batchgen.engine.cpu import host

    return f"{host.cpu_model()}, {torch.backends.cpu.get_cpu_capability()}"


def machine(args: argparse.Namespace) -> dict[str, Any]:
    from batchgen.engine.cpu import host

    return {
        "cpu": cpu_name(),
        "host": host.describe(),
        "contended": args.contended,
        "cores": os.cpu_count(),
        "torch_threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _model_in_own_process(name: str, argv: list[str]) -> dict[str, Any]:
    """One model's section, run by this script in a fresh process (the same options otherwise).

    Why: a process carries what earlier sections left behind (their models, a grown and
    fragmented heap), and it slowed the engine, not transformers: the 57M model's native (a) took
    17.4-18.1 s after the demo model's section in the same process, 15.6-16.0 s in one of its own,
    while `generate` took the same in both. Within a section both sides still share the process.
    """
    with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp:
        out = Path(tmp) / "report.json"
        # why appended: a later occurrence of an option overrides an earlier one (this model only,
        # its own JSON file, no table of its own)
        overrides = ["--models", name, "--out", str(out), "--no-markdown"]
        command = [sys.executable, str(Path(__file__).resolve()), *argv, *overrides]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["models"][name]


def _neighbours(contended: bool) -> contextlib.AbstractContextManager[Any]:
    return busy_neighbours() if contended else contextlib.nullcontext()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    transformers.logging.set_verbosity_error()
    # why: on CPU it logs an ERROR about psutil for memory sizing we do not use (num_blocks is given)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    torch.set_num_threads(args.threads)
    if args.sweep:
        return sweep.main([*(["--quick"] if args.quick else []), *(["--contended"] if args.contended else [])])
    began = time.perf_counter()
    if len(args.models) > 1 and not args.one_process:
        # each model's process runs its own busy neighbours (--contended is passed on)
        models = {name: _model_in_own_process(name, argv if argv is not None else sys.argv[1:]) for name in args.models}
    else:
        with tempfile.TemporaryDirectory(prefix="batchgen-bench-") as tmp, _neighbours(args.contended):
            models = {m.name: run_model(m, args) for m in bench_models.build(args.models, Path(tmp))}
    report = {
        "command": " ".join(["benchmarks/throughput.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "requests": args.requests,
        "machine": machine(args),
        "wall_seconds": round(time.perf_counter() - began, 1),
        "targets": targets(models),
        "models": models,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.markdown:
        results_md.update(report)
    return report


if __name__ == "__main__":
    main()
