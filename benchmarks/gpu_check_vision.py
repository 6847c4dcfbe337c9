"""Prepared GPU check of the vision path (issue 44): greedy tokens of the tiny vision-language
models on a CUDA device, float32, equal transformers' `generate` on the same device, under
pressure (7-token steps cutting through images, a small KV pool; preemption is the CPU tests') and
relaxed, each both "graphs" (compile on: the compiled forward, decode steps replayed from CUDA
graphs, Qwen2-VL's M-RoPE decode positions in the graphs' rope buffer) and "eager"; one JSON line
per family, setting and mode, with the graphs captured and replayed. Gemma 3 runs on the default
(triton) backend, its images attending both ways through the kernel's key bounds; a row with
"refused" names a backend that cannot take that mask.

    .venv/bin/python benchmarks/gpu_check_vision.py            # needs a CUDA device
    .venv/bin/python benchmarks/gpu_check_vision.py cpu        # the same on the CPU (a smoke run: no graphs)

Pass: every row "equal": true, and on CUDA every "graphs" row with "graph_replays" > 0 and
"captures_after_start" == 0.
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
from testkit.tiny_vision import image_prompts, save_tiny_vlm
from testkit.vision_reference import reference_tokens

FAMILIES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")
SETTINGS: dict[str, dict[str, Any]] = {
    "pressure": dict(block_size=16, max_num_batched_tokens=7, max_num_seqs=4, num_kv_blocks=12),
    "relaxed": dict(block_size=16, max_num_batched_tokens=1024, max_num_seqs=64, num_kv_blocks=512),
}


def check(family: str, folder: Path, setting: str, device: str, mode: str) -> dict[str, Any]:
    row: dict[str, Any] = {"family": family, "setting": setting, "device": device, "mode": mode}
    try:
        llm = LLM(str(folder), device=device, dtype="float32", compile=mode == "graphs", **SETTINGS[setting])
    except UnsupportedModelError as exc:
        return {**row, "refused": str(exc)}
    runner = llm.engine.runner
    row["backend"] = runner.backend.name
    assert llm._vision is not None
    items = image_prompts(llm._vision.processor.placeholder)[
        :4
    ]  # the first four: one image, two, a prefix hit, an image first
    outs = llm.generate(items, SamplingParams(max_tokens=8, temperature=0))
    ours = [o.outputs[0].token_ids if o.error is None else o.error for o in outs]
    theirs = reference_tokens(llm, folder, items, 8, device=device)
    graphs: Any = runner.graphs
    if graphs is not None:
        row["graph_replays"], row["captures_after_start"] = graphs.replays, graphs.captures_after_start
        row["graphs_disabled"] = graphs.disabled
    row["compiled_graphs"] = runner.forward.stats.graphs
    return {**row, "equal": ours == theirs, "ours": ours, "theirs": theirs, "stats": llm.stats}


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check_vision: no CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            folder = save_tiny_vlm(family, Path(tmp) / family)
            for setting in SETTINGS:
                for mode in ("graphs", "eager"):
                    print(json.dumps(check(family, folder, setting, device, mode)), flush=True)


if __name__ == "__main__":
    main()
