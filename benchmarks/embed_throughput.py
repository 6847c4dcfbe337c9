"""Embedding throughput: batchgen's `LLM.embed` against sentence-transformers' `encode` at its
best batch size, side by side in one run, on the same model folder and texts. JSON on stdout.

Two models: the demo model (sample_data/demo-model, a 4M decoder) as a last-token embedder,
which batchgen runs through its engine (packed varlen forwards, no padding, prefix reuse), and
a BERT built from a config (random weights, 4 layers, hidden 256; mean pooling), which batchgen
runs through transformers in length-ordered token-budget batches. Texts: the first --rows
prompts of sample_data/prompts.parquet. Each system runs --repeats times; the fastest run counts.
The two outputs are compared too (max abs difference: the same vectors, not just the same speed).

    .venv/bin/python benchmarks/embed_throughput.py --rows 400
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from testkit.pooling_models import bert_tokenizer, write_sentence_transformers  # noqa: E402

BATCH_SIZES = (8, 32, 128)


def demo_folder(tmp: Path) -> Path:
    """The demo model as a sentence-transformers folder (last-token pooling, normalized)."""
    path = tmp / "demo-embed"
    shutil.copytree(ROOT / "sample_data" / "demo-model", path)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    context = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    return write_sentence_transformers(path, "last", normalize=True, hidden_size=hidden, max_seq_length=context)


def bert_folder(tmp: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    path = tmp / "bert-embed"
    tokenizer = bert_tokenizer(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(path)
    return write_sentence_transformers(path, "mean", normalize=True, hidden_size=256, max_seq_length=512)


def best_of(repeats: int, run: Any, before: Any = None) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        result = run()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(path: Path, texts: list[str], repeats: int) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from batchgen import LLM

    llm = LLM(str(path), task="embed", device="cpu", dtype="float32")
    engine = llm.pooling_model().engine
    # why a cold cache each run: a repeat would otherwise find every prompt cached by the one before
    cold = engine.block_manager.reset_prefix_cache if engine is not None else None
    seconds, outs = best_of(repeats, lambda: llm.embed(texts), cold)
    no_cache = None
    if engine is not None:  # the same without prefix reuse: what the packed forwards alone give
        plain = LLM(str(path), task="embed", device="cpu", dtype="float32", enable_prefix_caching=False)
        no_cache = round(len(texts) / best_of(repeats, lambda: plain.embed(texts))[0], 1)
    ours = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
    model = SentenceTransformer(str(path), device="cpu")
    st: dict[str, float] = {}
    reference = None
    for size in BATCH_SIZES:
        st_seconds, reference = best_of(repeats, lambda size=size: model.encode(texts, batch_size=size))
        st[str(size)] = round(len(texts) / st_seconds, 1)
    best_size = max(st, key=lambda k: st[k])
    return {
        "runner": "engine" if llm.pooling_model().engine is not None else "transformers",
        "batchgen_rows_per_s": round(len(texts) / seconds, 1),
        "batchgen_rows_per_s_no_prefix_cache": no_cache,
        "st_rows_per_s_by_batch": st,
        "st_best_batch_size": int(best_size),
        "ratio_vs_st_best": round(len(texts) / seconds / st[best_size], 2),
        "max_abs_diff": float(np.abs(ours - reference).max()),
        "input_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    texts = pq.read_table(ROOT / "sample_data" / "prompts.parquet").column("prompt").to_pylist()[: args.rows]
    report: dict[str, Any] = {"rows": len(texts), "torch_threads": torch.get_num_threads(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        report["models"]["demo_decoder_last"] = measure(demo_folder(Path(tmp)), texts, args.repeats)
        report["models"]["bert_mean"] = measure(bert_folder(Path(tmp)), texts, args.repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
