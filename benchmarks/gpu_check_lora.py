"""A prepared LoRA check for a CUDA machine: the Triton LoRA kernels, compiled forwards and CUDA
graphs against transformers on manually merged weights. One short run, JSON out, no downloads.

    python benchmarks/gpu_check_lora.py --out lora_check.json         # on a CUDA machine (~1-2 min)
    TRITON_INTERPRET=1 python benchmarks/gpu_check_lora.py --smoke    # the eager part on the CPU

Why not peft: the GPU image holds torch, transformers (safetensors) and triton only. The adapters
are written here in peft's file layout (adapter_config.json + lora_A/lora_B keys), and the
reference merges them as peft's merge does for a Linear: W += (alpha / r) * B @ A.
Variants: eager (triton attention + LoRA kernels), compiled with CUDA graphs for decodes (skipped
with --smoke). Each must give every row its merged model's greedy tokens (float32).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.tiny_models import EOS_ID, save_random_model, tiny_configs  # noqa: E402

ADAPTERS = [  # (rank, alpha, targets)
    (4, 8.0, ("q_proj", "v_proj")),
    (16, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
]


def write_adapter(model: Any, folder: Path, rank: int, alpha: float, targets: tuple[str, ...], seed: int) -> Path:
    """A PEFT-layout LoRA folder for `model` (random A and B)."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, torch.nn.Linear):
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) / 8
            tensors[f"base_model.model.{name}.lora_B.weight"] = (
                torch.randn(module.out_features, rank, generator=gen) / 2
            )
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def merged_tokens(base: Path, adapter: tuple[Path, float] | None, prompts: list[list[int]], device: str) -> list:
    """Greedy tokens of `base` with the adapter merged by hand (None: the base), one prompt at a time."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        state = load_file(str(adapter[0] / "adapter_model.safetensors"))
        with torch.no_grad():
            for key, a in state.items():
                if ".lora_A." in key:
                    name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                    b = state[key.replace("lora_A", "lora_B")]
                    model.get_submodule(name).weight += adapter[1] * (b @ a)
    model.to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8,
                                 eos_token_id=EOS_ID, pad_token_id=EOS_ID)  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
    return out


def run_variant(base: Path, prompts: list[list[int]], requests: list[Any], want: list[Any], device: str,
                settings: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One engine variant over the mixed rows -> its figures. Why a function: its engine (and the KV
    pool it took, 0.9 of the GPU) is released on return, before the next variant sizes its own."""
    from batchgen import LLM, SamplingParams

    began = time.perf_counter()
    llm = LLM(str(base), device=device, dtype="float32", attention_backend="triton", enable_lora=True,
              max_loras=2, max_lora_rank=16, block_size=16, **settings)  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0), lora_request=requests)  # fmt: skip
    got = [o.outputs[0].token_ids for o in outs]
    graphs = getattr(llm.engine.runner, "graphs", None)
    return {
        "matched": sum(g == w for g, w in zip(got, want)),
        "of": len(want),
        "kernel_rank": next(iter(llm.engine.runner.lora.layers.values())).kernel_rank,  # type: ignore[union-attr]
        "graphs": graphs is not None,
        "replays": getattr(graphs, "replays", None),
        "seconds": round(time.perf_counter() - began, 2),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the eager variant on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    from batchgen import LoRARequest

    device = "cpu" if args.smoke else "cuda"
    result: dict[str, Any] = {"device": device, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        base = save_random_model(tiny_configs()["llama"], Path(tmp) / "base")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base)
        folders = [write_adapter(model, Path(tmp) / f"a{i}", *spec, seed=i) for i, spec in enumerate(ADAPTERS)]
        prompts = [[(7 * i + j) % 250 + 2 for j in range(5 + 9 * i)] for i in range(6)]
        which = [0, 1, None, 1, 0, None]
        want: list[Any] = [None] * len(prompts)
        for a in (None, 0, 1):
            rows = [i for i, w in enumerate(which) if w == a]
            adapter = None if a is None else (folders[a], ADAPTERS[a][1] / ADAPTERS[a][0])
            for i, tokens in zip(rows, merged_tokens(base, adapter, [prompts[i] for i in rows], device)):
                want[i] = tokens
        requests = [None if w is None else LoRARequest(f"a{w}", w + 1, str(folders[w])) for w in which]
        variants = (
            {"eager": dict(compile=False)}
            if args.smoke
            else {"eager": dict(compile=False), "compiled_graphs": dict(compile=True)}
        )
        for name, settings in variants.items():
            try:
                result["variants"][name] = run_variant(base, prompts, requests, want, device, settings)
            except Exception as exc:  # why broad: the report records each variant's failure and goes on
                result["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            gc.collect()  # why: the next variant's engine sizes its KV pool from the memory left free
    result["ok"] = all(  # why "of" in v: a variant that raised has neither figure (None == None)
        "of" in v and v["matched"] == v["of"] and (not v["graphs"] or (v["replays"] or 0) > 0)
        for v in result["variants"].values()
    )
    result["torch"] = torch.__version__
    text = json.dumps(result, indent=2)
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
