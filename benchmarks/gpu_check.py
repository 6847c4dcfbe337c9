"""The prepared GPU check: one script, under 7 minutes on one GPU, no downloads, JSON after each section.

    python benchmarks/gpu_check.py --out gpu_check.json          # on a CUDA machine
    python benchmarks/gpu_check.py --smoke --out smoke.json      # tiny sizes on CPU (a test runs it)

Sections (each records its own error and the next one still runs):
  0 versions, the GPU, the attention path per dtype / block size, and which kernels each call
    shape (prefill, continuation chunk, decode, mixed) actually launches (torch profiler)
  1 fp32 greedy parity vs transformers `generate` for the parity tests' architectures
  2 a ~1B Llama-shaped random model in bf16: logits after prefill and greedy agreement length
  3 throughput: 256 prompts of 256-768 tokens, 128 output tokens, ignore_eos, vs transformers
    `generate` in bf16 at its best batch size; a shared-prefix variant; per-step breakdown; syncs
  4 memory: KV pool vs free memory, peak allocated, one worst-case long chunk
  5 section 3's workload with `compile=True` and 16-token blocks (on CUDA: decode steps replayed as
    CUDA graphs), last because a CUDA error there can poison the process's CUDA context
Every model is built from a config with random weights and saved to a temp dir. Imports only
torch, transformers (and its tokenizers) and batchgen.engine: what the GPU image has. Sections 1-2
live in gpu_check_parts.py, 3-4 in gpu_check_perf.py; this file is the one to run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import random
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import transformers

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention import path as attention_path
from batchgen.engine.core.scheduler import ScheduledBatch
from batchgen.engine.llm import LLM
from batchgen.testing.tiny_models import EOS_ID, save_random_model

log = logging.getLogger("gpu_check")
EOS = EOS_ID  # id 0 of the tiny word tokenizer
ATTENTION_OPS = ("attention", "flash", "fmha", "varlen", "softmax", "index_select", "bmm", "cutlass")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass
class Sizes:
    device: str
    archs: list[str]
    parity_prompts: int
    big: dict[str, Any]  # LlamaConfig kwargs of the bf16 model
    agree_prompts: int
    agree_tokens: int
    n_prompts: int
    prompt_lens: tuple[int, int]
    out_tokens: int
    hf_batches: list[int]
    shared_prefix: int
    breakdown_prompts: int
    long_chunk: int  # prompt tokens of section 4's worst-case chunk (two chunks at the token budget)
    engine: dict[str, Any] = field(default_factory=dict)  # extra engine settings (smoke: small CPU budgets)


BIG_1B = dict(  # Llama-3.2-1B's shape: ~1.24B parameters
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
ALL_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "gpt_neox"]
# why a 400-token preamble: not a multiple of 256, so 256-token blocks share only 256 of it (the cost
# of the varlen kernel's block size shows in section 3's shared-prefix rows)
FULL = Sizes("cuda", ALL_ARCHS, 24, BIG_1B, 8, 64, 256, (256, 768), 128, [64, 128, 256], 400, 64, 16384)
SMOKE = Sizes(
    device="cpu",
    archs=["llama", "gemma2"],  # gemma2: soft-capping, always the gather + SDPA path
    parity_prompts=3,
    big=dict(
        BIG_1B,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    agree_prompts=2,
    agree_tokens=6,
    n_prompts=6,
    prompt_lens=(16, 40),
    out_tokens=5,
    hf_batches=[6],
    shared_prefix=24,
    breakdown_prompts=4,
    long_chunk=160,
    engine={"max_num_batched_tokens": 96, "max_num_seqs": 8},
)


# ----------------------------------------------------------------------------- plumbing


class Report:
    """The JSON document, rewritten whole (atomically) after every section."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def section(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        start = time.perf_counter()
        try:
            result = fn()
        except Exception as exc:  # why: one failing section must not cost the others' figures
            log.exception("section %s failed", name)
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 1)
        self.data[name] = result
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def save_model(config: Any, path: Path, device: str, seed: int = 0) -> Path:
    """A random-weight model of `config` saved with its word tokenizer; device memory freed after."""
    save_random_model(config, path, seed, device)
    free_memory()
    return path


def random_prompts(
    n: int, lens: tuple[int, int], vocab: int, seed: int, prefix: list[int] | None = None
) -> list[list[int]]:
    rng = random.Random(seed)
    return [(prefix or []) + [rng.randrange(1, vocab) for _ in range(rng.randint(*lens))] for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------- section 0


def step_shape(batch: ScheduledBatch) -> str:
    decodes = [c.is_decode for c in batch.chunks]
    if all(decodes):
        return "decode"
    if any(decodes):
        return "mixed"
    return "continuation" if any(c.start > 0 for c in batch.chunks) else "prefill"


@contextlib.contextmanager
def capture_batches(llm: LLM) -> Iterator[list[ScheduledBatch]]:
    runner, seen = llm.engine.runner, []
    real = runner.execute

    def execute(batch: ScheduledBatch) -> torch.Tensor:
        seen.append(batch)
        return real(batch)

    runner.execute = execute  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        runner.execute = real  # type: ignore[method-assign]


def profiled_step(llm: LLM, device: str) -> tuple[str, list[str], dict[str, int]]:
    """One engine step under the torch profiler -> (its shape, attention-ish ops/kernels, sync calls)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with capture_batches(llm) as seen, torch.profiler.profile(activities=activities) as prof:
        llm.engine.step()
        sync(device)
    names = {e.key: e.count for e in prof.key_averages()}
    ops = sorted(k for k in names if any(p in k.lower() for p in ATTENTION_OPS))
    syncs = {k: names.get(k, 0) for k in (*SYNC_CALLS, "cudaMemcpyAsync")}
    return step_shape(seen[0]), ops[:16], syncs


def call_shapes(path: Path, device: str, dtype: torch.dtype, block_size: int) -> dict[str, Any]:
    """Run prefill / continuation / decode / mixed steps and record what each launched."""
    llm = LLM(
        str(path),
        device=device,
        dtype=dtype,
        block_size=block_size,
        max_num_batched_tokens=256,
        max_num_seqs=4,
        enable_prefix_caching=False,
        num_kv_blocks=64,
    )
    runner = llm.engine.runner
    shapes: dict[str, Any] = {}
    for prompts in ([[5] * 100], [[7] * 600], [[9] * 100, [11] * 600]):
        for p in prompts:
            llm.engine.add_request(p, greedy(3))
        while llm.engine.has_unfinished():
            shape, ops, syncs = profiled_step(llm, device)
            shapes.setdefault(shape, {"ops": ops, "sync_calls": syncs})
    result = {"path": runner.attention.path, "reason": runner.attention.reason, "shapes": shapes}
    del llm, runner
    free_memory()
    return result


def section0(sizes: Sizes, work: Path) -> dict[str, Any]:
    from batchgen.engine.runner.models import resolve_device

    device = resolve_device(sizes.device)
    gpu: dict[str, Any] | None = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "capability": list(torch.cuda.get_device_capability(device)),
            "total_gib": round(props.total_memory / 2**30, 1),
        }
    support = attention_path.detect_support(device)
    choices = {
        f"{str(dt).removeprefix('torch.')}/block{bs}": asdict(
            attention_path.choose_attention_path(device.type, dt, bs, 64, False, support)
        )
        for dt in (torch.bfloat16, torch.float16, torch.float32)
        for bs in (16, 256)
    }
    tiny = save_model(
        transformers.LlamaConfig(**dict(SMOKE.big, vocab_size=256, max_position_embeddings=2048)),
        work / "tiny-shapes",
        sizes.device,
    )
    observed = {"float32/block16": call_shapes(tiny, sizes.device, torch.float32, 16)}
    if device.type == "cuda":  # (the smoke run keeps to one: the CPU takes the same path for each)
        observed["bfloat16/block16"] = call_shapes(tiny, sizes.device, torch.bfloat16, 16)
        observed["bfloat16/block256"] = call_shapes(tiny, sizes.device, torch.bfloat16, 256)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "gpu": gpu,
        "varlen_paged_supported": support.varlen_paged,
        "accelerate_installed": transformers.utils.is_accelerate_available(),
        "path_choice": choices,
        "observed": observed,
    }


def _hf_tok_s(report: Report) -> float | None:
    """Section 3's best `generate` output tok/s, for section 5's ratio (None when section 3 did not run)."""
    hf = report.data.get("3_throughput", {}).get("hf_generate_bf16")
    return None if not isinstance(hf, dict) else hf.get("output_tok_s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU, for the test that keeps this alive")
    parser.add_argument("--sections", default="012345", help="which sections to run (default all)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sizes = SMOKE if args.smoke else FULL
    if sizes.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; use --smoke for the CPU run", file=sys.stderr)
        return 2
    from benchmarks import gpu_check_parts as parts
    from benchmarks import gpu_check_perf as perf

    report = Report(args.out)
    report.data["mode"] = "smoke" if args.smoke else "full"
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        runs: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("0_environment", lambda: section0(sizes, work)),
            ("1_fp32_parity", lambda: parts.section1(sizes, work)),
            ("2_bf16_agreement", lambda: parts.section2(sizes, work)),
            ("3_throughput", lambda: perf.section3(sizes, work)),
            ("4_memory", lambda: perf.section4(sizes, work)),
            ("5_compiled", lambda: perf.section5(sizes, work, _hf_tok_s(report))),
        ]
        for name, fn in runs:
            if name[0] in args.sections:
                report.section(name, fn)
    report.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report.write()
    print(json.dumps({k: v.get("error", "ok") if isinstance(v, dict) else v for k, v in report.data.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
