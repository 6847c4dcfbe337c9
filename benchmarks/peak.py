"""The machine's own limit, measured in the same run as the figures it judges: torch's 4096x4096
matmul in float32 and bfloat16 (GFLOP/s), and a workload's model FLOPs, so an engine's tokens/s
becomes a fraction of what this CPU can compute.

Why measured, never looked up: a shared or throttled host reaches a fraction of its datasheet; a
ratio against a matmul timed beside the run says how near the engine is to this host's limit now.
Model FLOPs (the usual count): 2 x non-embedding, non-head parameters per token processed (prompt
and generated), plus the LM head for each token whose logits are taken (each output token), plus
attention: 4 x layers x heads x head_dim per token per position of its context (scores and values).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

MATMUL_N = 4096


def matmul_gflops(dtype_name: str, n: int = MATMUL_N, seconds: float = 2.0) -> float:
    """The best GFLOP/s of an n x n x n matmul in `dtype_name` over about `seconds` (after a warm-up)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: packing, thread start
    best, spent = 0.0, 0.0
    while spent < seconds:
        started = time.perf_counter()
        torch.mm(a, b, out=out)
        took = time.perf_counter() - started
        spent += took
        best = max(best, 2 * n**3 / took / 1e9)
    return round(best, 1)


def native_bf16_note() -> dict[str, Any]:
    """Whether this CPU computes bf16 natively (dtype_rule's flags), for a benchmark's bf16 rows."""
    from batchgen.engine.api.dtype_rule import native_bf16

    native, why = native_bf16()
    return {"native_bf16": native, "why": why if native else f"{why}: bf16 is emulated here, its rows say so"}


def peaks() -> dict[str, Any]:
    """Both matmul peaks, measured now, and whether bf16 is native."""
    return {
        "matmul_n": MATMUL_N,
        "float32_gflops": matmul_gflops("float32"),
        "bfloat16_gflops": matmul_gflops("bfloat16"),
        **native_bf16_note(),
    }


def best_of(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """The run's peaks: the higher of each dtype's start and end figure (a busy spell at either end
    lowers one), with both kept."""
    keys = ("float32_gflops", "bfloat16_gflops")
    return {
        **start,
        **{k: max(start[k], end[k]) for k in keys},
        "at_start": {k: start[k] for k in keys},
        "at_end": {k: end[k] for k in keys},
    }


def model_flops(config: Any, prompts: Sequence[int], max_tokens: int) -> float:
    """Model FLOPs of a greedy workload: prompts of these lengths, each generating max_tokens."""
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attn_proj = hidden * heads * head_dim * 2 + hidden * kv * head_dim * 2  # q, o; k, v
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    body = layers * (attn_proj + mlp)  # the norms' few parameters are left out
    tokens = sum(prompts) + len(prompts) * max_tokens
    positions = sum(_context_sum(p, max_tokens) for p in prompts)  # sum over tokens of their context length
    return (
        2.0 * body * tokens
        + 2.0 * hidden * vocab * len(prompts) * max_tokens
        + 4.0 * layers * heads * head_dim * positions
    )


def _context_sum(prompt: int, generated: int) -> int:
    total = prompt + generated  # tokens 1..total, each attending over its own position and those before
    return total * (total + 1) // 2


def achieved(flops: float, seconds: float, peak_gflops: float) -> dict[str, float]:
    """GFLOP/s reached and its fraction of a peak."""
    gflops = flops / seconds / 1e9
    return {"gflops": round(gflops, 1), "of_peak": round(gflops / peak_gflops, 3) if peak_gflops else 0.0}
