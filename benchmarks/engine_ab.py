"""The engine's own figures of two trees, side by side: run this once per tree, alternately.

    PYTHONPATH=OLD .venv/bin/python benchmarks/engine_ab.py OLD     # prints one JSON line
    PYTHONPATH=NEW .venv/bin/python benchmarks/engine_ab.py NEW

Why: comparing two versions of the engine (a refactor that must not slow it) needs only the engine's
timed regions, not throughput.py's transformers baselines, which take most of its time. For the tree
given it imports that tree's own benchmarks/ code and times, in one process: the native rows of
`throughput.py --quick` (demo and 57M models, workloads a and b, compiled as by default) and the
engine column of `sweep.py --quick` (its three shapes). Seconds of each timed region, lower is better.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def main(tree: Path) -> dict[str, Any]:
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    from transformers import AutoConfig

    from benchmarks import bench_models, sweep, systems, workloads

    out: dict[str, Any] = {"tree": str(tree), "load_start": os.getloadavg()}
    work = Path(tempfile.mkdtemp(prefix="batchgen-ab-"))
    for model in bench_models.build(["demo", "large"], work):
        config = AutoConfig.from_pretrained(model.path)
        eos = config.eos_token_id
        special = {eos} if isinstance(eos, int) else set(eos or [])
        mixed = workloads.mixed(16, config.vocab_size, special, max_out=64)  # throughput.py --quick's (a)
        prefix = workloads.shared_prefix(16, config.vocab_size, special)  # and its (b)
        out[f"{model.name}_a"] = systems.run_native(model.path, mixed).seconds
        out[f"{model.name}_b"] = systems.run_native(model.path, prefix).seconds
    for name in sweep.QUICK:
        shape = next(s for s in sweep.SHAPES if s.name == name)
        sweep.save_model(shape, work / name)
        out[f"sweep_{name}"] = sweep.run_engine(work / name, sweep.workload(shape), shape.max_tokens)
    out["load_end"] = os.getloadavg()
    return out


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]).resolve())))
