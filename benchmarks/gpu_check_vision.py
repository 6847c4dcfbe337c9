"""Prepared GPU check of the vision path (issue 44): greedy tokens of the tiny vision-language
models on a CUDA device, float32, equal transformers' `generate` on the same device, under
pressure (7-token steps cutting through images, a small KV pool; preemption is the CPU tests') and
relaxed; one JSON line per family and setting. Gemma 3 is expected refused on CUDA (its
bidirectional image attention runs on the torch/cpu prefill path only), and reported so.

    .venv/bin/python benchmarks/gpu_check_vision.py            # needs a CUDA device
    .venv/bin/python benchmarks/gpu_check_vision.py cpu        # the same on the CPU (a smoke run)
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.runner.models import UnsupportedModelError
from testkit.tiny_vision import sample_image, save_tiny_vlm
from testkit.vision_reference import reference_tokens

FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")
SETTINGS: dict[str, dict[str, Any]] = {
    "pressure": dict(block_size=16, max_num_batched_tokens=7, max_num_seqs=4, num_kv_blocks=12),
    "relaxed": dict(block_size=16, max_num_batched_tokens=1024, max_num_seqs=64, num_kv_blocks=512),
}


def prompts(placeholder: str) -> list[dict[str, Any]]:
    a, b, c = sample_image(40, 24, 1), sample_image(64, 64, 2), sample_image(20, 50, 3)
    return [
        {"prompt": f"w5 {placeholder} w7 w8", "multi_modal_data": {"image": a}},
        {"prompt": f"w9 {placeholder} w3 {placeholder} w4", "multi_modal_data": {"image": [b, c]}},
        {"prompt": f"w5 {placeholder} w7 w9 w10", "multi_modal_data": {"image": a}},
        {"prompt": f"{placeholder} w11", "multi_modal_data": {"image": [c]}},
    ]


def check(family: str, folder: Path, setting: str, device: str) -> dict[str, Any]:
    row: dict[str, Any] = {"family": family, "setting": setting, "device": device}
    try:
        llm = LLM(str(folder), device=device, dtype="float32", **SETTINGS[setting])
    except UnsupportedModelError as exc:
        return {**row, "refused": str(exc)}
    assert llm._vision is not None
    items = prompts(llm._vision.processor.placeholder)
    outs = llm.generate(items, SamplingParams(max_tokens=8, temperature=0))
    ours = [o.outputs[0].token_ids if o.error is None else o.error for o in outs]
    theirs = reference_tokens(llm, folder, items, 8, device=device)
    return {**row, "equal": ours == theirs, "ours": ours, "theirs": theirs, "stats": llm.stats}


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check_vision: no CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            folder = save_tiny_vlm(family, Path(tmp) / family)
            for setting in SETTINGS:
                print(json.dumps(check(family, folder, setting, device)), flush=True)


if __name__ == "__main__":
    main()
