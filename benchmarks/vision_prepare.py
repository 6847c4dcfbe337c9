"""The runner's per-step image work (engine/vision: `prepare`, building the splice and the M-RoPE
positions) beside the forward it feeds, A/B against another revision's encoder in one process.

    .venv/bin/python benchmarks/vision_prepare.py --baseline main          # 64 requests, 32 tokens
    .venv/bin/python benchmarks/vision_prepare.py --baseline main --families qwen2_vl

Why: with the forward compiled, a tiny VLM's step is short enough that Python work per chunk or
per token in `prepare` shows. One LLM per family; its runner's image state is swapped between this
tree's VisionInputs and the baseline revision's (`git show REV:batchgen/engine/vision/encoder.py`
loaded as a module), runs interleaved A, B, A, B (the prefix cache emptied before each), each
side's best run reported: the whole generate, the forwards and the `prepare` calls summed over
the run's steps (`prepare` split: decoding new images, Pillow and the image processor, and the
rest: splice rows, M-RoPE positions, claims), and whether both sides' greedy tokens are equal. CPU, float32, compiled.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from batchgen import LLM, SamplingParams
from benchmarks.vision import workload
from testkit.tiny_vision import save_tiny_vlm

ROOT = Path(__file__).resolve().parents[1]


def baseline_class(rev: str, tmp: Path) -> type:
    """VisionInputs as revision `rev` of this repository defines it."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:batchgen/engine/vision/encoder.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = tmp / "baseline_encoder.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_encoder", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # why: its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.VisionInputs  # type: ignore[no-any-return]


class _Timed:
    """Wraps a callable (or a StepForward, its other attributes passed through), summing its time."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - began

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def timed_run(llm: LLM, vision: Any, prompts: list[dict[str, Any]], params: SamplingParams) -> dict[str, Any]:
    """One generate with `vision` as the runner's image state -> seconds: total, forward, prepare."""
    runner: Any = llm.engine.runner
    runner.vision = vision
    forward, prepare, decode = _Timed(runner.forward), _Timed(vision.prepare), _Timed(vision._decode)
    runner.forward, vision.prepare, vision._decode = forward, prepare, decode
    llm.engine.scheduler.block_manager.reset_prefix_cache()  # why: no run reuses another's blocks
    try:
        began = time.perf_counter()
        outs = llm.generate(prompts, params)
        total = time.perf_counter() - began
    finally:
        runner.forward = forward.inner
        del vision.prepare, vision._decode
    return {
        "total_s": total,
        "forward_s": forward.seconds,
        "prepare_s": prepare.seconds,
        "decode_s": decode.seconds,  # inside prepare: Pillow and the image processor, per new image
        "prepare_rest_s": prepare.seconds - decode.seconds,  # splice, positions, claims
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def measure(family: str, folder: Path, baseline: type, args: argparse.Namespace) -> dict[str, Any]:
    placeholder = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}[family]
    prompts = workload(placeholder, args.requests, repeated=False)
    llm = LLM(str(folder), device="cpu", dtype="float32", compile=True)
    ours: Any = llm.engine.runner.vision
    theirs = baseline(ours.lm, ours.tower, ours.mrope, ours.cache.cap, ours.cache.auto)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    sides: dict[str, tuple[Any, list[dict[str, Any]]]] = {"baseline": (theirs, []), "this_tree": (ours, [])}
    for vision, _ in sides.values():  # warm-up: every shape once, on both sides
        timed_run(llm, vision, prompts, SamplingParams(max_tokens=2, temperature=0))
    for _ in range(args.repeats):
        for vision, runs in sides.values():
            runs.append(timed_run(llm, vision, prompts, params))

    def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
        return min(runs, key=lambda r: r["total_s"])

    result: dict[str, Any] = {"family": family, "requests": args.requests, "max_tokens": args.max_tokens}
    for name, (_, runs) in sides.items():
        b = best(runs)
        result[name] = {k: round(b[k], 4) for k in ("total_s", "forward_s", "prepare_s", "decode_s", "prepare_rest_s")}
        result[name]["prepare_rest_s_all_runs"] = [round(r["prepare_rest_s"], 4) for r in runs]
    rest = [result[name]["prepare_rest_s"] for name in sides]
    result["prepare_rest_speedup"] = round(rest[0] / max(rest[1], 1e-9), 2)
    result["tokens_equal"] = all(
        a["tokens"] == b["tokens"] for a, b in zip(sides["baseline"][1], sides["this_tree"][1], strict=True)
    )
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="main", help="the git revision whose encoder is side A")
    p.add_argument("--families", nargs="+", default=["qwen2_vl", "llava"])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="interleaved runs per side; the best counts")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        baseline = baseline_class(args.baseline, Path(tmp))
        for family in args.families:
            results.append(measure(family, save_tiny_vlm(family, Path(tmp) / family), baseline, args))
    json.dump({"baseline": args.baseline, "torch_threads": args.threads, "results": results}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
