"""LoRA throughput: rows of 4 adapters mixed in one engine vs the base model alone, and vs peft
serving one adapter at a time with transformers' generate; side by side in one run. JSON out.

Systems, on the same random-weight Llama, prompts and machine, greedy, EOS ignored:
  base  batchgen's LLM on the base model, every row without adapter (the engine's defaults);
  lora  batchgen's LLM with enable_lora (max_loras 4, max_lora_rank 16), rows round-robin over
        4 adapters (ranks 8 and 16, all seven projections), every step mixing them;
  peft  transformers + peft: the 4 adapters loaded into one PeftModel (unmerged, as served), each
        adapter's rows in one left-padded generate batch after set_adapter (adapter loading not timed).
Ratios (the figures; absolute times on a shared machine are noise): lora/base (goal >= 0.75) and
lora/peft (goal >= 3). Each system runs --repeats times, the fastest counts. `agree` is the share
of rows whose tokens equal peft's (greedy on random weights: padding may flip near-ties).

    nice .venv/bin/python benchmarks/lora.py --out /tmp/lora.json
"""

from __future__ import annotations

import argparse
import json
import random
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


def best(repeats: int, run: Any) -> tuple[float, Any]:
    fastest, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest, result


def run_engine(base: Path, prompts: list[list[int]], adapters: list[Path] | None, args: Any) -> tuple[float, list]:
    from batchgen import LLM, LoRARequest, SamplingParams

    settings: dict[str, Any] = dict(enable_lora=True, max_loras=4, max_lora_rank=16) if adapters else {}
    llm = LLM(str(base), device="cpu", dtype="float32", **settings)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    requests = None
    if adapters:
        requests = [LoRARequest(f"a{i % 4}", i % 4 + 1, str(adapters[i % 4])) for i in range(len(prompts))]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(inputs[:8], params, lora_request=requests[:8] if requests else None)  # warm up (compile)
    seconds, outs = best(args.repeats, lambda: llm.generate(inputs, params, lora_request=requests))
    return seconds, [o.outputs[0].token_ids for o in outs]


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

    return best(args.repeats, run)


def measure(shape: str, args: Any) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters = build(shape, Path(tmp))
        prompts = workload(args.rows, SHAPES[shape]["vocab_size"])
        out_tokens = args.rows * args.max_tokens
        base_s, _ = run_engine(base, prompts, None, args)
        lora_s, lora_tokens = run_engine(base, prompts, adapters, args)
        peft_s, peft_tokens = run_peft(base, prompts, adapters, args)
    agree = sum(a == b for a, b in zip(lora_tokens, peft_tokens)) / len(prompts)
    return {
        "shape": shape,
        **SHAPES[shape],
        "output_tokens": out_tokens,
        "tokens_per_s": {"base": out_tokens / base_s, "lora": out_tokens / lora_s, "peft": out_tokens / peft_s},
        "lora_vs_base": base_s / lora_s,
        "lora_vs_peft": peft_s / lora_s,
        "agree_with_peft": agree,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
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
