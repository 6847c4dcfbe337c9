"""LoRA throughput: rows of 4 adapters mixed in one engine vs the base model alone, and vs peft
serving one adapter at a time with transformers' generate; side by side in one run. JSON out.

Systems, on the same random-weight Llama, prompts and machine, greedy, EOS ignored:
  base  batchgen's LLM on the base model, every row without adapter (the engine's defaults);
  lora  batchgen's LLM with enable_lora (max_loras 4, max_lora_rank 16), rows round-robin over
        4 adapters (ranks 8 and 16, all seven projections), every step mixing them;
  peft  transformers + peft: the 4 adapters loaded into one PeftModel (unmerged, as served), each
        adapter's rows in one left-padded generate batch after set_adapter (adapter loading not timed).
Ratios (the figures; absolute times on a shared machine are noise): lora/base (goal >= 0.75) and
lora/peft (goal >= 3). base and lora are both built and warmed up on the whole workload first (every
step size compiled, the adapters in their slots: the steady state is timed), then timed in turn for
--repeats rounds (base first in even rounds, lora first in odd ones): `round_ratios` are base/lora
seconds of each round, `lora_vs_base_median` their median, `lora_vs_base` best against best. The
1-minute load average is recorded at each shape's start and end. peft runs after, best of
--peft-repeats (0: not run). `agree` is the share of rows whose tokens equal peft's (greedy on
random weights: padding may flip near-ties).

    nice .venv/bin/python benchmarks/lora.py --out /tmp/lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.tiny_lora import save_tiny_adapter  # noqa: E402
from testkit.tiny_models import save_random_model  # noqa: E402

SHAPES = {
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, vocab_size=2048),
    "medium": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, vocab_size=4096),
    "large": dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=4, vocab_size=4096),
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANKS = (8, 16, 8, 16)


def build(shape: str, folder: Path) -> tuple[Path, list[Path]]:
    from transformers import LlamaConfig

    config = LlamaConfig(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         eos_token_id=0, bos_token_id=0, pad_token_id=0, **SHAPES[shape])  # fmt: skip
    base = save_random_model(config, folder / "base")
    adapters = [
        save_tiny_adapter(base, folder / f"a{i}", r=r, alpha=2 * r, target_modules=TARGETS, seed=i, scale=0.05)
        for i, r in enumerate(RANKS)
    ]
    return base, adapters


def workload(rows: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, vocab) for _ in range(rng.randrange(32, 97))] for _ in range(rows)]


def timed(run: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def make_engine(base: Path, prompts: list[list[int]], adapters: list[Path] | None, args: Any) -> Any:
    """A warmed-up (compiled) engine and a call that runs the whole workload on it -> token ids per row."""
    from batchgen import LLM, LoRARequest, SamplingParams

    settings: dict[str, Any] = dict(enable_lora=True, max_loras=4, max_lora_rank=16) if adapters else {}
    llm = LLM(str(base), device="cpu", dtype="float32", **settings)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    requests = None
    if adapters:
        requests = [LoRARequest(f"a{i % 4}", i % 4 + 1, str(adapters[i % 4])) for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs, params, lora_request=requests)  # warm up: every step size's graph compiled, slots loaded

    def run() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(inputs, params, lora_request=requests)]

    return run


def interleaved(base: Path, prompts: list[list[int]], adapters: list[Path], args: Any) -> dict[str, Any]:
    """base and lora engines built side by side, then timed in turn, round after round: each round's
    ratio is taken within seconds, so the machine's drift moves both sides alike."""
    runs = {"base": make_engine(base, prompts, None, args), "lora": make_engine(base, prompts, adapters, args)}
    seconds: dict[str, list[float]] = {"base": [], "lora": []}
    tokens: list[Any] = []
    for i in range(args.repeats):
        for name in ("base", "lora") if i % 2 == 0 else ("lora", "base"):  # neither side always first
            took, out = timed(runs[name])
            seconds[name].append(took)
            if name == "lora":
                tokens = out
    ratios = [b / lo for b, lo in zip(seconds["base"], seconds["lora"])]
    return {"seconds": seconds, "round_ratios": ratios, "tokens": tokens}


def run_peft(base: Path, prompts: list[list[int]], adapters: list[Path], args: Any) -> tuple[float, list]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), str(adapters[0]), adapter_name="a0"
    )
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    model.eval()

    def run() -> list[list[int]]:
        tokens: list[list[int]] = [[] for _ in prompts]
        for a in range(len(adapters)):
            model.set_adapter(f"a{a}")
            rows = list(range(a, len(prompts), len(adapters)))
            width = max(len(prompts[r]) for r in rows)
            ids = torch.tensor([[0] * (width - len(prompts[r])) + prompts[r] for r in rows])
            mask = torch.tensor([[0] * (width - len(prompts[r])) + [1] * len(prompts[r]) for r in rows])
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0,
                                     max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens)  # fmt: skip
            for j, r in enumerate(rows):
                tokens[r] = out[j, width:].tolist()
        return tokens

    return min(timed(run) for _ in range(args.peft_repeats))


def measure(shape: str, args: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters = build(shape, Path(tmp))
        prompts = workload(args.rows, SHAPES[shape]["vocab_size"])
        out_tokens = args.rows * args.max_tokens
        load = os.getloadavg()[0]
        pair = interleaved(base, prompts, adapters, args)
        peft = run_peft(base, prompts, adapters, args) if args.peft_repeats else None
    base_s, lora_s = min(pair["seconds"]["base"]), min(pair["seconds"]["lora"])
    result: dict[str, Any] = {
        "shape": shape,
        **SHAPES[shape],
        "output_tokens": out_tokens,
        "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],  # at the start and the end
        "seconds": {k: [round(x, 3) for x in v] for k, v in pair["seconds"].items()},
        "round_ratios": [round(r, 3) for r in pair["round_ratios"]],
        "lora_vs_base_median": round(statistics.median(pair["round_ratios"]), 3),
        "lora_vs_base": round(base_s / lora_s, 3),  # best of each side
        "tokens_per_s": {"base": out_tokens / base_s, "lora": out_tokens / lora_s},
    }
    if peft is not None:
        peft_s, peft_tokens = peft
        result["tokens_per_s"]["peft"] = out_tokens / peft_s
        result["lora_vs_peft"] = round(peft_s / lora_s, 3)
        result["agree_with_peft"] = sum(a == b for a, b in zip(pair["tokens"], peft_tokens)) / len(prompts)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4, help="rounds of base and lora in turn")
    parser.add_argument("--peft-repeats", type=int, default=1, help="0: peft not run")
    parser.add_argument("--shapes", default="small,medium")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    result = {
        "rows": args.rows,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "shapes": [measure(s, args) for s in args.shapes.split(",")],
        "goals": {"lora_vs_base": 0.75, "lora_vs_peft": 3.0},
    }
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
