"""Images in: batchgen's engine vs transformers' `generate` (best static batch) on tiny random
LLaVA and Qwen2-VL, with distinct images and with repeated ones (a catalogue: each image asked
several questions), one run, JSON on stdout.

    .venv/bin/python benchmarks/vision.py                  # 64 requests per workload
    .venv/bin/python benchmarks/vision.py --requests 16    # quick

Same folders, prompts and images for both systems, greedy, float32, CPU; each system's best of
`--repeats` timed runs after a warm-up (the engine's prefix cache emptied before each run).
Reported per family and workload: images/s and output tokens/s of each system, the ratio, the engine's cached prompt
tokens and tower runs, and whether the greedy tokens agree. Absolute times on a shared machine are
noise; the ratios, measured side by side, are the figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from batchgen import LLM, SamplingParams
from testkit.tiny_vision import sample_image, save_tiny_vlm


def workload(placeholder: str, requests: int, repeated: bool) -> list[dict[str, Any]]:
    """`requests` prompts of one image each; repeated: 8 images, each asked requests/8 questions
    (the same leading text and image, then the question)."""
    sizes = [(40, 24), (64, 64), (20, 50), (48, 32), (56, 40), (32, 32), (24, 64), (64, 40)]
    distinct = 8 if repeated else requests
    images = [sample_image(*sizes[i % len(sizes)], seed=i) for i in range(distinct)]
    return [
        {
            "prompt": f"w3 w4 {placeholder} w{10 + i % 50} w{60 + i % 40}",
            "multi_modal_data": {"image": images[i % distinct]},
        }
        for i in range(requests)
    ]


def run_engine(folder: Path, prompts: list[dict[str, Any]], max_tokens: int, repeats: int) -> dict[str, Any]:
    """The best of `repeats` timed runs, each on an empty prefix cache (a warm-up run first)."""
    llm = LLM(str(folder), device="cpu", dtype="float32")
    vision = llm.engine.runner.vision  # type: ignore[attr-defined]
    block_manager = llm.engine.scheduler.block_manager
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0))  # warm-up: every shape once
    best: dict[str, Any] = {}
    for _ in range(repeats):
        block_manager.reset_prefix_cache()  # why: a repeat must not reuse the previous run's blocks
        runs_before = vision.tower_runs
        began = time.perf_counter()
        outs = llm.generate(prompts, params)
        seconds = time.perf_counter() - began
        if not best or seconds < best["seconds"]:
            best = {
                "seconds": seconds,
                "tokens": [o.outputs[0].token_ids for o in outs],
                "cached_tokens": sum(o.num_cached_tokens for o in outs),
                "tower_runs": vision.tower_runs - runs_before,
                "llm": llm,
            }
    return best


def hf_batch(llm: LLM, model: Any, batch: list[dict[str, Any]], max_tokens: int) -> list[list[int]]:
    """One static, left-padded batch through transformers' generate."""
    vision = llm._vision
    assert vision is not None
    expanded = [vision.prompt(llm.tokenizer(p["prompt"])["input_ids"], p["multi_modal_data"], "hf")[0] for p in batch]
    width = max(len(e) for e in expanded)
    ids = torch.tensor([[0] * (width - len(e)) + e for e in expanded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in expanded])
    images = [p["multi_modal_data"]["image"].convert("RGB") for p in batch]
    pixels = vision.processor.image_processor(images=images, return_tensors="pt")
    kwargs = {k: v for k, v in pixels.items() if k in ("pixel_values", "image_grid_thw")}
    if vision.processor.family == "qwen2_vl":
        kwargs["mm_token_type_ids"] = (ids == vision.processor.image_token_id).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            **kwargs,
        )  # fmt: skip
    return out[:, width:].tolist()


def run_hf(
    llm: LLM, folder: Path, prompts: list[dict[str, Any]], max_tokens: int, sizes: list[int], repeats: int
) -> dict[str, Any]:
    """The best static batch size, each size's best of `repeats` runs (a warm-up batch first)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    hf_batch(llm, model, prompts[: sizes[0]], 2)  # warm-up
    best: dict[str, Any] = {}
    for size in [s for s in sizes for _ in range(repeats)]:
        began = time.perf_counter()
        tokens = []
        for i in range(0, len(prompts), size):
            tokens.extend(hf_batch(llm, model, prompts[i : i + size], max_tokens))
        seconds = time.perf_counter() - began
        if not best or seconds < best["seconds"]:
            best = {"seconds": seconds, "batch_size": size, "tokens": tokens}
    return best


def measure(
    family: str, folder: Path, requests: int, max_tokens: int, repeated: bool, sizes: list[int], repeats: int
) -> dict[str, Any]:
    placeholder = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}[family]
    prompts = workload(placeholder, requests, repeated)
    ours = run_engine(folder, prompts, max_tokens, repeats)
    theirs = run_hf(ours.pop("llm"), folder, prompts, max_tokens, sizes, repeats)
    output = requests * max_tokens
    agree = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
    return {
        "family": family,
        "workload": "repeated images" if repeated else "distinct images",
        "requests": requests,
        "max_tokens": max_tokens,
        "batchgen": {
            "images_per_s": round(requests / ours["seconds"], 2),
            "output_tok_per_s": round(output / ours["seconds"], 1),
            "cached_prompt_tokens": ours["cached_tokens"],
            "tower_runs": ours["tower_runs"],
        },
        "transformers_generate": {
            "images_per_s": round(requests / theirs["seconds"], 2),
            "output_tok_per_s": round(output / theirs["seconds"], 1),
            "best_batch_size": theirs["batch_size"],
        },
        "speedup": round(theirs["seconds"] / ours["seconds"], 2),
        "greedy_agreement": f"{agree}/{requests}",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per system and size; the best counts")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llava", "qwen2_vl"):
            folder = save_tiny_vlm(family, Path(tmp) / family)
            for repeated in (False, True):
                args_ = (args.requests, args.max_tokens, repeated, args.batch_sizes, args.repeats)
                results.append(measure(family, folder, *args_))
    json.dump({"torch_threads": args.threads, "repeats": args.repeats, "results": results}, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
