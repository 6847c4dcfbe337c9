"""The prepared GPU check (benchmarks/gpu_check.py) in its CPU --smoke mode, so it cannot rot unseen.

It runs as a script in a subprocess where the packages the GPU image lacks (pydantic, ray,
xgrammar, ...) cannot be imported, and every section must produce its figures without error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOT_ON_THE_GPU_IMAGE = ("pydantic", "pydantic_core", "ray", "xgrammar", "jsonschema", "boto3", "moto")

RUNNER = """
import runpy, sys
BLOCKED = set(sys.argv[1].split(","))
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is not on the GPU image", name=name)
        return None
sys.meta_path.insert(0, Block())
script, out = sys.argv[2], sys.argv[3]
sys.argv = [script, "--smoke", "--out", out]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_section_without_the_packages_the_gpu_image_lacks(tmp_path: Path) -> None:
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = [
        sys.executable,
        "-c",
        RUNNER,
        ",".join(NOT_ON_THE_GPU_IMAGE),
        str(REPO / "benchmarks/gpu_check.py"),
        str(out),
    ]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = ["0_environment", "1_fp32_parity", "2_bf16_agreement", "3_throughput", "4_memory", "5_compiled"]
    assert [s for s in sections if "error" in report.get(s, {"error": "missing"})] == []

    env0 = report["0_environment"]
    assert env0["path_choice"]["bfloat16/block256"]["path"] == "sdpa"  # CPU: never the varlen kernel
    shapes = env0["observed"]["float32/block16"]["shapes"]
    assert set(shapes) == {"prefill", "continuation", "decode", "mixed"}
    sdpa, batched, kernel = (
        {n for n, s in shapes.items() if any(k in op for op in s["ops"])}
        for k in ("scaled_dot", "baddbmm", "native_decode_attention")
    )
    # CPU float32: prompts through SDPA, decodes over the decode rows in the native kernel
    assert sdpa == {"prefill", "continuation", "mixed"} and kernel == {"decode", "mixed"} and not batched

    parity = report["1_fp32_parity"]
    assert parity["all_matched"] and set(parity) >= {"llama", "gemma2"}

    agree = report["2_bf16_agreement"]["sdpa/block16"]
    assert agree["top1_agree"] == 2 and agree["greedy_agreement_len"] == [6, 6]  # same CPU kernels: exact

    tp = report["3_throughput"]
    assert tp["native_bf16"]["stats"]["output_tokens"] == 6 * 5
    assert tp["shared_prefix"]["native_caching_on"]["stats"]["cached_tokens"] > 0
    assert tp["shared_prefix"]["native_caching_off"]["stats"]["cached_tokens"] == 0
    steps = tp["per_step"]
    assert steps["profiled_decode_shapes"] == ["decode", "decode"]
    assert steps["sync_counters_per_decode_step"] is not None or "no sync" in steps["sync_counters_note"]
    assert set(steps["decode_step_ms"]) >= {"metadata", "forward", "sampler", "stop_checks", "step_total"}

    memory = report["4_memory"]
    assert memory["worst_case_long_chunk"][0]["chunks"] == [[0, 96], [96, 64]]  # a continuation over 96 tokens
    assert memory["section3_engine"]["pool_blocks"] > 0

    compiled = report["5_compiled"]
    # compiled (on the CPU earlier sections may have compiled this model already: engine.compile "auto")
    assert compiled["stats"]["output_tokens"] == 6 * 5 and compiled["compiled"]
    assert compiled["cuda_graphs_captured"] is None  # CPU: compiled, no CUDA graphs
    assert compiled["compiled_over_hf_best"] is not None  # section 3's generate figure reached it
