"""What a grammar mask costs: the same prompts and exactly the same number of output tokens, with and
without structured output, on the demo model; plus the share of wall time spent in logits processing.

Both runs set min_tokens = max_tokens so that every row makes exactly max_tokens tokens; the
constrained run uses a regex that never has to end (prose characters), so its mask is filled and
applied on every step, as a JSON schema's is. Runs alternate (A B A B ...) because the machine may
be shared: report the best of each.

    PYTHONPATH=$PWD python benchmarks/structured_cost.py [--rows 128] [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pyarrow.parquet as pq

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROSE = r"[A-Za-z ,.!']*"


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, float, int]:
    """(wall seconds, seconds inside logits processing, output tokens)."""
    features = llm.engine.runner.sampler.features  # type: ignore[union-attr]  # the engine's runner samples
    assert features is not None
    spent = [0.0]
    apply, accept = features.apply, features.accept

    def timed_apply(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return apply(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    def timed_accept(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return accept(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    features.apply, features.accept = timed_apply, timed_accept  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        features.apply, features.accept = apply, accept  # type: ignore[method-assign]
    return wall, spent[0], sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    prompts = pq.read_table(ROOT / "sample_data/prompts.parquet").column("prompt").to_pylist()[: args.rows]
    llm = LLM(str(ROOT / "sample_data/demo-model"), device="cpu", dtype="float32")
    same = {"max_tokens": args.tokens, "min_tokens": args.tokens, "temperature": 0.0}
    kinds = {"unconstrained": SamplingParams(**same), "regex mask": SamplingParams(**same, structured={"regex": PROSE})}
    _run(llm, prompts[:8], kinds["regex mask"])  # warm-up: compile the grammar, fill caches
    best: dict[str, tuple[float, float, int]] = {}
    for _ in range(args.repeats):
        for name, params in kinds.items():
            result = _run(llm, prompts, params)
            if name not in best or result[0] < best[name][0]:
                best[name] = result
    for name, (wall, spent, tokens) in best.items():
        print(f"{name:14s} {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tok/s; logits processing {spent:.2f}s")
    ratio = best["regex mask"][0] / best["unconstrained"][0]
    print(f"cost of the mask: {ratio:.2f}x wall time (goal <= 1.3x)")


if __name__ == "__main__":
    main()
