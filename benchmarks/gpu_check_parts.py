"""Sections 1 and 2 of benchmarks/gpu_check.py and the helpers 3 and 4 share (run that script)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
import transformers as tf
from transformers import AutoModelForCausalLM, GenerationConfig

from batchgen.engine.core.scheduler import ScheduledBatch
from batchgen.engine.llm import LLM
from batchgen.testing.tiny_models import tiny_configs
from benchmarks.gpu_check import (
    EOS,
    Sizes,
    common_prefix,
    free_memory,
    greedy,
    random_prompts,
    save_model,
)


def big_model(sizes: Sizes, work: Path) -> Path:
    path = work / "big"
    if not (path / "config.json").is_file():
        save_model(
            tf.LlamaConfig(**sizes.big, bos_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS), path, sizes.device
        )
    return path


def load_hf(path: Path, device: str, dtype: torch.dtype, attn: str | None = "sdpa") -> Any:
    """transformers' model; attn None: its default attention (what the parity tests compare with)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, device: str) -> list[list[int]]:
    """One left-padded greedy `generate` call; EOS never stops it."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=EOS, eos_token_id=-1
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    return [row[width:].tolist() for row in out.cpu()]


# ----------------------------------------------------------------------------- section 1


def parity_configs() -> dict[str, Any]:
    """The parity tests' tiny architectures (batchgen/testing/tiny_models.py), vocab 256."""
    return tiny_configs()


PARITY_SETTINGS = {
    "pressure": dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=24),
    "relaxed": dict(block_size=8, max_num_batched_tokens=1024, max_num_seqs=64, enable_prefix_caching=False),
}


def parity_prompts(n: int) -> tuple[list[list[int]], list[int]]:
    shared = random_prompts(1, (96, 96), 256, seed=7)[0]
    prompts = random_prompts(n, (1, 300), 256, seed=8) + random_prompts(n, (0, 60), 256, seed=9, prefix=shared)
    return prompts, [1 + i % 12 for i in range(len(prompts))]


def section1(sizes: Sizes, work: Path) -> dict[str, Any]:
    prompts, max_tokens = parity_prompts(sizes.parity_prompts)
    configs, result = parity_configs(), {}
    for arch in sizes.archs:
        path = save_model(configs[arch], work / f"parity-{arch}", sizes.device)
        model = load_hf(path, sizes.device, torch.float32, attn=None)
        expected = [hf_generate(model, [p], m, sizes.device)[0] for p, m in zip(prompts, max_tokens)]
        del model
        free_memory()
        row: dict[str, Any] = {}
        for name, settings in PARITY_SETTINGS.items():
            llm = LLM(str(path), device=sizes.device, dtype="float32", **settings)
            outs = llm.generate(prompts, [greedy(m) for m in max_tokens])
            bad = [i for i, (o, e) in enumerate(zip(outs, expected)) if list(o.outputs[0].token_ids) != e]
            row[name] = {
                "matched": len(prompts) - len(bad),
                "of": len(prompts),
                "mismatched": bad[:10],
                "attention": llm.engine.runner.attention.path,
            }
            del llm
            free_memory()
        result[arch] = row
    result["all_matched"] = all(s["matched"] == s["of"] for r in result.values() for s in r.values())
    return result


# ----------------------------------------------------------------------------- section 2


def engine_prefill_and_greedy(path: Path, sizes: Sizes, prompts: list[list[int]], block: int | None) -> dict[str, Any]:
    llm = LLM(str(path), device=sizes.device, dtype="bfloat16", block_size=block, **sizes.engine)
    runner = llm.engine.runner
    real = runner.execute
    logits: list[torch.Tensor] = []

    def execute(batch: ScheduledBatch) -> torch.Tensor:
        out = real(batch)
        if not logits:
            logits.append(out.float().cpu())
        return out

    runner.execute = execute  # type: ignore[method-assign]
    outs = llm.generate(prompts, greedy(sizes.agree_tokens))
    info = {
        "block_size": runner.block_size,
        "attention": runner.attention.path,
        "logits": logits[0],
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }
    del llm, runner
    free_memory()
    return info


def section2(sizes: Sizes, work: Path) -> dict[str, Any]:
    path = big_model(sizes, work)
    vocab = sizes.big["vocab_size"]
    prompts = random_prompts(sizes.agree_prompts, sizes.prompt_lens, vocab, seed=2)
    runs = [engine_prefill_and_greedy(path, sizes, prompts, None)]
    if runs[0]["block_size"] != 16:  # the default took the varlen kernel: compare the gather path too
        runs.append(engine_prefill_and_greedy(path, sizes, prompts, 16))
    model = load_hf(path, sizes.device, torch.bfloat16)
    with torch.inference_mode():
        ref = torch.stack([model(torch.tensor([p], device=sizes.device)).logits[0, -1].float().cpu() for p in prompts])
    ref_tokens = [hf_generate(model, [p], sizes.agree_tokens, sizes.device)[0] for p in prompts]
    params = sum(p.numel() for p in model.parameters())
    del model
    free_memory()
    result: dict[str, Any] = {"params": params, "prompts": len(prompts), "greedy_tokens": sizes.agree_tokens}
    for run in runs:
        got: torch.Tensor = run["logits"]
        top5 = [len(set(a.topk(5).indices.tolist()) & set(b.topk(5).indices.tolist())) / 5 for a, b in zip(got, ref)]
        agree = [common_prefix(a, b) for a, b in zip(run["tokens"], ref_tokens)]
        result[f"{run['attention']}/block{run['block_size']}"] = {
            "max_abs_logit_diff": round(float((got - ref).abs().max()), 4),
            "mean_abs_logit_diff": round(float((got - ref).abs().mean()), 5),
            "logit_scale": round(float(ref.abs().mean()), 4),
            "top1_agree": int((got.argmax(-1) == ref.argmax(-1)).sum()),
            "top5_overlap_mean": round(statistics.mean(top5), 3),
            "greedy_agreement_len": agree,
            "greedy_agreement_len_median": statistics.median(agree),
        }
    return result
