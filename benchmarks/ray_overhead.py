"""What the Ray executor costs and how it spreads the parts, on this machine's CPUs.

    .venv/bin/python benchmarks/ray_overhead.py            # ~10 min on a quiet 2-core machine

Three runs of jobs/quickstart.yaml (the demo model, the first `--rows` 300 sample prompts,
greedy, `--max-tokens` 96) with `engine.window_rows: --window` (50: 6 parts), each a fresh
in-process `JobRunner.run()`, Ray start-up and shutdown included: `kind: local`, `kind: ray`
with 1 worker on all CPUs, and 2 workers x 1 CPU.
Then 2 workers on 2,400 sample rows (window 100: 24 parts, `--tail-max-tokens` each) for the
parts each worker took and how long each sat idle at the end (the straggler tail). Cached-token
totals show what splitting the parts over two prefix caches costs.

Prints one JSON object. The machine's load average is recorded beside each run: on a shared
machine the wall-time ratios move with the neighbours' load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "jobs" / "quickstart.yaml"


def run_once(out: Path, overrides: list[str]) -> dict[str, Any]:
    """One job run in this process; wall seconds from before the job load to after Ray's shutdown."""
    from batchgen.job.spec import load_job
    from batchgen.run.runner import JobRunner

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    runner = JobRunner(load_job(JOB, [f"output.path={out}", *overrides]), quiet=True)
    summary = runner.run()
    wall = time.perf_counter() - start
    tokens = summary.manifest["tokens"]
    result: dict[str, Any] = {
        "wall_s": round(wall, 2),
        "rows": summary.totals.rows,
        "input_tokens": tokens["input"],
        "cached_tokens": tokens["cached"],
        "output_tokens": tokens["output"],
        "load_avg_1min_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    stats = getattr(runner.executor, "stats", None)
    if stats is not None:
        result["parts_per_worker"] = [len(parts) for parts in stats.parts]
        result["parts_taken"] = stats.parts
        result["tail_idle_s"] = stats.tail_idle()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=300, help="rows of the overhead runs (quickstart: 300)")
    parser.add_argument("--window", type=int, default=50, help="engine.window_rows of the overhead runs")
    parser.add_argument("--max-tokens", type=int, default=96, help="max_tokens of the overhead runs (quickstart: 96)")
    parser.add_argument("--tail-rows", type=int, default=2400)
    parser.add_argument("--tail-max-tokens", type=int, default=16, help="max_tokens of the 2,400-row run")
    args = parser.parse_args()
    import ray  # noqa: F401

    import batchgen.engine.llm  # noqa: F401  why: torch and transformers imported before any timing

    ray_1 = ["executor.kind=ray", "executor.num_workers=1"]  # worker_cpus null: all the CPUs
    ray_2 = ["executor.kind=ray", "executor.num_workers=2", "executor.worker_cpus=1"]
    base = [f"input.limit={args.rows}", f"engine.window_rows={args.window}", f"sampling.max_tokens={args.max_tokens}"]
    tail = [f"input.limit={args.tail_rows}", "engine.window_rows=100", f"sampling.max_tokens={args.tail_max_tokens}"]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in [
            ("local", base),
            ("ray_1_worker_all_cpus", base + ray_1),
            ("ray_2_workers_1_cpu", base + ray_2),
            ("tail_ray_2_workers_1_cpu", tail + ray_2),
        ]:
            runs[name] = run_once(Path(tmp) / name, overrides)
            print(json.dumps({name: runs[name]}), file=sys.stderr, flush=True)  # a long run's figures so far
    local, one, two = runs["local"], runs["ray_1_worker_all_cpus"], runs["ray_2_workers_1_cpu"]
    report = {
        "machine": {"cpus": os.cpu_count(), "shared": "yes: other jobs ran beside this one; see load averages"},
        "job": f"{JOB.relative_to(REPO)} + {base}",
        "runs": runs,
        "ray_1_worker_vs_local_wall_ratio": round(one["wall_s"] / local["wall_s"], 3),
        "ray_2x1cpu_vs_1x2cpu_wall_ratio": round(two["wall_s"] / one["wall_s"], 3),
        "cached_tokens": {
            name: runs[name]["cached_tokens"] for name in ("local", "ray_1_worker_all_cpus", "ray_2_workers_1_cpu")
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
