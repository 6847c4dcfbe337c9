"""Shape sweep: the engine with its native kernels, without them (BATCHGEN_NATIVE=0), and transformers.

    .venv/bin/python benchmarks/sweep.py                 # every shape, JSON on stdout
    .venv/bin/python benchmarks/sweep.py --quick         # three small shapes, fewer requests
    .venv/bin/python benchmarks/sweep.py --contended     # with one busy process per core beside each run
    .venv/bin/python benchmarks/sweep.py --precision     # float32 engine vs bf16 (auto) vs transformers bf16

Why: the kernels were tuned on two models and one CPU; a fast path must hold on shapes it was not
tuned on (hidden 128-4096, intermediate ratios, vocabularies 4k-128k, tied and untied heads, GQA
ratios, prompt lengths 16-2,048). For each shape a random-weight Llama is saved with a word-level
tokenizer, and each system runs the same seeded greedy workload (EOS ignored, so every request
produces exactly its max_tokens) in a fresh process of its own: the kernels are chosen per process.
The figure is output tokens/s; `native_vs_off` below 1.0 means the kernels made that shape slower.
transformers runs `generate` in static batches of 16 (its padding costs are part of its figure).
--precision runs instead the engine in float32, the engine with `dtype: auto` on the same weights
stored in bf16 (bf16 where the CPU has it natively: engine/api/dtype_rule) and transformers in
bf16, and reports each one's model GFLOP/s as a fraction of the 4096^3 matmul peak of its dtype,
measured at the start of the same run (benchmarks/peak.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.busy import busy_neighbours


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    prompt_min: int
    prompt_max: int
    requests: int
    max_tokens: int


SHAPES = [
    Shape("h128-v4k-tied", 128, 512, 2, 4, 4, 4096, True, 16, 128, 48, 64),
    Shape("h256-v8k-tied", 256, 768, 4, 4, 4, 8192, True, 16, 512, 48, 64),  # issue 28's first shape
    Shape("h512-v32k-gqa4", 512, 1376, 4, 8, 2, 32768, False, 16, 512, 32, 48),  # issue 28's second
    Shape("h768-v8k-gqa3", 768, 2048, 8, 12, 4, 8192, False, 16, 512, 32, 48),
    Shape("h1024-mha-ratio4", 1024, 4096, 2, 16, 16, 16384, True, 16, 256, 32, 32),
    Shape("h2048-v32k-gqa4", 2048, 5632, 2, 16, 4, 32768, False, 16, 256, 16, 32),
    Shape("h4096-v32k-gqa4", 4096, 11008, 1, 32, 8, 32768, False, 16, 128, 16, 16),
    Shape("h512-v128k", 512, 1408, 2, 8, 8, 131072, False, 16, 256, 16, 32),
    Shape("h256-mqa-long", 256, 1024, 2, 4, 1, 4096, True, 1024, 2048, 12, 32),
    # throughput.py's 57M Llama (bench_models.large_config) on a mixed-length workload like its own
    Shape("h768-57m-throughput", 768, 2048, 8, 12, 4, 259, False, 16, 512, 64, 64),
]
QUICK = ["h128-v4k-tied", "h256-v8k-tied", "h512-v32k-gqa4"]
SYSTEMS = ("native", "off", "transformers")
PRECISION_SYSTEMS = ("native", "bf16", "transformers_bf16")  # native: the engine in float32
BF16_SYSTEMS = ("bf16", "transformers_bf16")
HF_BATCH = 16


def save_model(shape: Shape, path: Path, bf16: bool = False) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.prompt_max + shape.max_tokens + 16, tie_word_embeddings=shape.tied,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    (model.to(torch.bfloat16) if bf16 else model).save_pretrained(path)  # same seed: the same weights, rounded
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape.vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1", pad_token="t1").save_pretrained(path)


def workload(shape: Shape) -> list[list[int]]:
    rng = random.Random(0)
    return [
        [rng.randrange(2, shape.vocab) for _ in range(rng.randint(shape.prompt_min, shape.prompt_max))]
        for _ in range(shape.requests)
    ]


def run_engine(path: Path, prompts: list[list[int]], max_tokens: int, dtype: str = "float32") -> float:
    from batchgen import LLM
    from batchgen.engine.api.params import SamplingParams

    llm = LLM(str(path), device="cpu", dtype=dtype)
    for n in (2, 3):  # compiling and the kernels' calibration happen here, outside the timing
        llm.generate([[5, 6, 7, 8]] * n, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - started


def run_transformers(path: Path, prompts: list[list[int]], max_tokens: int, dtype: str = "float32") -> float:
    """transformers' `generate` in left-padded static batches of HF_BATCH, as throughput.py runs it."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.systems import static_batch
    from benchmarks.workloads import Request

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    requests = [Request(prompt, max_tokens) for prompt in prompts]
    started = time.perf_counter()
    for first in range(0, len(requests), HF_BATCH):
        static_batch(model, None, requests[first : first + HF_BATCH], ignore_eos=True)
    return time.perf_counter() - started


def worker(system: str, shape: Shape, path: Path, threads: int) -> dict[str, Any]:
    """One system on one shape, in this (fresh) process."""
    import torch

    from batchgen.engine.cpu import host

    torch.set_num_threads(threads)
    prompts = workload(shape)
    run = run_transformers if system.startswith("transformers") else run_engine
    dtype = "bfloat16" if system == "transformers_bf16" else "auto" if system == "bf16" else "float32"
    seconds = run(path, prompts, shape.max_tokens, dtype)
    return {
        "tok_s": round(len(prompts) * shape.max_tokens / seconds, 1),
        "seconds": round(seconds, 2),
        "host": host.describe(),
    }


def measure(
    shape: Shape, work: Path, threads: int, contended: bool, repeats: int, peak: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Each system `repeats` times, in turn (native, off, transformers, native, ...): the best run of
    each is its figure, so a slow spell of a shared host falls on every system alike. With `peak`
    (--precision), the precision systems and each one's share of its dtype's matmul peak."""
    systems = PRECISION_SYSTEMS if peak is not None else SYSTEMS
    for bf16 in (False, True) if peak is not None else (False,):
        path = work / (shape.name + ("-bf16" if bf16 else ""))
        if not (path / "config.json").exists():
            save_model(shape, path, bf16)
    row: dict[str, Any] = {"shape": asdict(shape), **{system: 0.0 for system in systems}}
    for _ in range(repeats):
        for system in systems:
            path = work / (shape.name + ("-bf16" if system in BF16_SYSTEMS else ""))
            result = _run_worker(system, shape, path, threads, contended)
            row[system] = max(row[system], result["tok_s"])
            row["host"] = result["host"]
    if peak is not None:
        return row  # its figures come at the end of the run (precision_figures), against the best peak
    row["native_vs_off"] = round(row["native"] / row["off"], 2)
    row["native_vs_transformers"] = round(row["native"] / row["transformers"], 2)
    return row


def precision_figures(shape: Shape, row: dict[str, Any], peak: dict[str, Any], work: Path) -> dict[str, Any]:
    """bf16's factors over the float32 engine and transformers bf16, and each system's model GFLOP/s
    as a fraction of its dtype's matmul peak."""
    from transformers import AutoConfig

    from benchmarks.peak import achieved, model_flops

    flops = model_flops(
        AutoConfig.from_pretrained(work / shape.name), [len(p) for p in workload(shape)], shape.max_tokens
    )
    out: dict[str, Any] = {"model_gflop": round(flops / 1e9, 1)}
    for system in PRECISION_SYSTEMS:
        seconds = shape.requests * shape.max_tokens / row[system]
        top = peak["bfloat16_gflops"] if system in BF16_SYSTEMS else peak["float32_gflops"]
        out[f"{system}_achieved"] = achieved(flops, seconds, top)
    out["bf16_vs_float32"] = round(row["bf16"] / row["native"], 2)
    out["bf16_vs_transformers_bf16"] = round(row["bf16"] / row["transformers_bf16"], 2)
    return out


def _run_worker(system: str, shape: Shape, path: Path, threads: int, contended: bool) -> dict[str, Any]:
    env = {**os.environ, "BATCHGEN_NATIVE": "0" if system == "off" else os.environ.get("BATCHGEN_NATIVE", "1")}
    command = [sys.executable, __file__, "--worker", system, shape.name, str(path), str(threads)]
    with busy_neighbours() if contended else contextlib.nullcontext():
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="three small shapes")
    p.add_argument("--contended", action="store_true", help="one busy process per core beside every run")
    p.add_argument("--shapes", nargs="+", default=None, choices=[s.name for s in SHAPES])
    p.add_argument("--repeats", type=int, default=1, help="runs of each system per shape, in turn; the best counts")
    p.add_argument("--precision", action="store_true", help="float32 engine vs bf16 (auto) vs transformers bf16")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's own choice)")
    p.add_argument("--worker", nargs=4, metavar=("SYSTEM", "SHAPE", "PATH", "THREADS"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = p.parse_args(argv)
    by_name = {s.name: s for s in SHAPES}
    if args.worker:
        system, name, path, threads = args.worker
        print(json.dumps(worker(system, by_name[name], Path(path), int(threads))))
        return {}
    from batchgen.engine.cpu import host

    threads = args.threads or host.usable_cpus()
    names = args.shapes or (QUICK if args.quick else list(by_name))
    peak = None
    if args.precision:
        import torch

        from benchmarks.peak import peaks

        torch.set_num_threads(threads)
        peak = peaks()  # measured now, beside the runs it judges
    with tempfile.TemporaryDirectory(prefix="batchgen-sweep-") as tmp:
        rows = [measure(by_name[name], Path(tmp), threads, args.contended, args.repeats, peak) for name in names]
        if peak is not None:  # measured again at the end: fractions of the best the host showed in this run
            from benchmarks.peak import best_of, peaks

            peak = best_of(peak, peaks())
            rows = [{**r, **precision_figures(by_name[r["shape"]["name"]], r, peak, Path(tmp))} for r in rows]
    report = {
        "command": " ".join(["benchmarks/sweep.py", *(argv if argv is not None else sys.argv[1:])]),
        "contended": args.contended,
        "threads": threads,
        "native_flags": os.environ.get("BATCHGEN_NATIVE_CFLAGS", ""),
        "host": rows[0]["host"] if rows else host.describe(),
        "peak": peak,
        "load_average": os.getloadavg(),
        "slower_with_kernels": [r["shape"]["name"] for r in rows if r.get("native_vs_off", 1.0) < 0.95],
        "shapes": [{k: v for k, v in r.items() if k != "host"} for r in rows],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
