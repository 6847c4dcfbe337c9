"""Where a decode step's time goes, bf16 against float32, on the sweep's shapes: torch.profiler.

    nice .venv/bin/python benchmarks/profile_bf16.py --shapes h1024-mha-ratio4 h2048-v32k-gqa4 --requests 32

For each shape: its seeded model saved in bf16, two engines on it (`dtype: auto`, bf16 on a native-bf16
CPU, and `dtype: float32`), each warmed up (compiled, calibrated), then timed alternately (best of
--rounds, in this one process: a busy host hits both alike), then each profiled over the same workload.
Ops are summed by self CPU time into groups (matmul, attention, conversions, sampling, the compiled
graph's own fused work, the rest), so the share of each is read directly. JSON out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GROUPS = {  # first match wins: substrings of the op's name
    "matmul": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "aten::baddbmm",
        "batchgen_linear",
        "batchgen::linear",
        "batchgen::packed_linear",
        "aten::linear",
        "mkldnn",
    ),
    "attention": ("batchgen::decode", "attention", "flash", "softmax"),
    "conversions": ("aten::to", "aten::_to_copy", "aten::copy_"),
    "sampling": ("argmax", "aten::max", "aten::amax", "isnan", "log_softmax", "topk"),
    "compiled graph (fused elementwise)": ("Compiled", "Torch-Compiled", "graph_", "cpp_fused"),
}


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS.items():
        if any(k.lower() in low for k in keys):
            return group
    return "other"


def profile(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        began = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - began
    groups: dict[str, float] = {}
    top = []
    for event in prof.key_averages():
        us = event.self_cpu_time_total
        groups[group_of(event.key)] = groups.get(group_of(event.key), 0.0) + us
        top.append((us, event.key, event.count))
    top.sort(reverse=True)
    total = sum(groups.values()) or 1.0
    return {
        "wall_s_profiled": round(wall, 2),
        "groups_s": {k: round(v / 1e6, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "groups_share": {k: round(v / total, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_ops": [{"op": k, "self_s": round(us / 1e6, 3), "calls": n} for us, k, n in top[:18]],
    }


def shape_run(
    shape: Any, requests: int, max_tokens: int, rounds: int, packed_ab: bool = False, variants: Any = ()
) -> dict[str, Any]:
    """variants: (name, "VAR=VALUE") pairs, each a further `dtype: auto` engine built with that
    variable set (e.g. ("forced", "BATCHGEN_PACKED_LINEAR=1")), timed in turn with the others."""
    from batchgen.engine.api.params import SamplingParams
    from batchgen.engine.llm import LLM
    from benchmarks import sweep

    shape = dataclasses.replace(shape, requests=requests, max_tokens=max_tokens)
    path = Path(tempfile.mkdtemp(prefix=f"bf16-profile-{shape.name}-"))
    sweep.save_model(shape, path, bf16=True)
    prompts = sweep.workload(shape)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engines = {
        "auto": LLM(str(path), device="cpu", dtype="auto"),
        "float32": LLM(str(path), device="cpu", dtype="float32"),
    }
    if packed_ab:  # the same bf16 engine with no weight packed (engine/cpu/packed_linear): before vs after
        variants = [("auto_unpacked", "BATCHGEN_PACKED_LINEAR=0"), *variants]
    for name, setting in variants:
        var, value = setting.split("=", 1)
        before = os.environ.get(var)
        os.environ[var] = value
        try:
            engines[name] = LLM(str(path), device="cpu", dtype="auto")
        finally:
            if before is None:
                del os.environ[var]
            else:
                os.environ[var] = before
    for llm in engines.values():
        for n in (2, 3):  # compiling and calibration, outside the timing
            llm.generate([[5, 6, 7, 8]] * n, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        llm.generate(prompts[:4], params)
    best = dict.fromkeys(engines, float("inf"))
    loads = []
    for _ in range(rounds):
        for name, llm in engines.items():
            began = time.perf_counter()
            llm.generate(prompts, params)
            best[name] = min(best[name], time.perf_counter() - began)
        loads.append(round(os.getloadavg()[0], 1))
    tokens = requests * max_tokens
    out: dict[str, Any] = {
        "shape": shape.name,
        "load_per_round": loads,
        "auto_dtype": str(engines["auto"].engine.runner.model.dtype),
        "tok_s": {k: round(tokens / v, 1) for k, v in best.items()},
        "auto_over_float32": round(best["float32"] / best["auto"], 2),
        "auto_packed_layers": sum(
            type(m).__name__ == "PackedLinear" for m in engines["auto"].engine.runner.model.modules()
        ),
    }
    for name, _ in variants:
        out[f"{name}_over_float32"] = round(best["float32"] / best[name], 2)
        out[f"auto_over_{name}"] = round(best[name] / best["auto"], 2)
        out[f"{name}_packed_layers"] = sum(
            type(m).__name__ == "PackedLinear" for m in engines[name].engine.runner.model.modules()
        )
    if variants:
        return out  # timings only: the profile is of the plain A/B
    out["profile"] = {name: profile(llm, prompts, params) for name, llm in engines.items()}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks import sweep

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["h1024-mha-ratio4", "h2048-v32k-gqa4"])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--packed-ab", action="store_true", help="also bf16 with no packed weight; no profile")
    p.add_argument(
        "--variant",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VAR=VALUE"),
        help="also a bf16 engine built with VAR=VALUE in its environment; no profile",
    )
    args = p.parse_args(argv)
    by_name = {s.name: s for s in sweep.SHAPES}
    out: dict[str, Any] = {"load_start": os.getloadavg(), "shapes": []}
    for name in args.shapes:
        out["shapes"].append(
            shape_run(by_name[name], args.requests, args.max_tokens, args.rounds, args.packed_ab, args.variant)
        )
        out[f"load_after_{name}"] = os.getloadavg()
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    json.dump(main(), sys.stdout, indent=1)
    print()
