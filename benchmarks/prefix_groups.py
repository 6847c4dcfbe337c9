"""Prefix grouping across the whole input (input.grouping), measured as a user runs a job: the CLI
on the demo model, documents x questions with the rows shuffled, a KV pool that holds a fraction
of the documents, in one process and over 2 and 4 static shards, grouping `auto` against `none`.

The figure is prefill tokens computed (the manifest's input minus cached tokens) over the ideal:
every prompt's tokens once, less each shared prefix's whole blocks after its first use (an
unbounded prefix cache over the whole input, as the block manager matches: full blocks, chained,
the last token always computed). Wall time is the sum over the job's processes (shards run one
after another here: on this 2-core machine concurrent shards would only share the cores).

    python benchmarks/prefix_groups.py --docs 40 --questions 4 --window 20 --out /tmp/pg.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "sample_data" / "demo-model"
QUESTIONS = [
    "Who is the story about?",
    "Where does the story happen?",
    "What happens at the end?",
    "How does the main character feel?",
    "What is the lesson of the story?",
    "Give the story a title.",
]
BLOCK = 16


def documents(count: int, openings_per_doc: int) -> list[str]:
    """`count` documents, each a few of the sample prompts' story openings run together."""
    table = pq.read_table(REPO / "sample_data" / "prompts.parquet", columns=["prompt", "category"])
    openings = [p for p, c in zip(*(table.column(n).to_pylist() for n in ("prompt", "category"))) if c == "opening"]
    return [" ".join(openings[d * openings_per_doc : (d + 1) * openings_per_doc]) for d in range(count)]


def write_input(folder: Path, docs: list[str], questions: int, seed: int) -> Path:
    rows = [(d, q) for d in range(len(docs)) for q in range(questions)]
    random.Random(seed).shuffle(rows)
    prompts = [f"Document:\n{docs[d]}\n\nQuestion: {QUESTIONS[q % len(QUESTIONS)]}\nAnswer:" for d, q in rows]
    path = folder / "in.parquet"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(len(rows))], "prompt": prompts}), path)
    return path


def ideal_computed(prompts: list[str]) -> tuple[int, int]:
    """(prompt tokens, tokens computed with each shared prefix's whole blocks computed once)."""
    from batchgen.inputs.prepare import load_tokenizer
    from batchgen.usage.estimate import prefix_cache_hits

    tokenizer = load_tokenizer(MODEL)
    ids = [list(i) for i in tokenizer(prompts)["input_ids"]]
    total = sum(len(i) for i in ids)
    return total, total - prefix_cache_hits(sorted(ids), BLOCK)


def run_job(folder: Path, data: Path, grouping: str, shards: int, args: argparse.Namespace) -> dict[str, Any]:
    out = folder / f"out-{grouping}-{shards}"
    job = {
        "model": {"path": str(MODEL)},
        "input": {"path": str(data), "id_column": "id", "grouping": grouping},
        "output": {"path": str(out)},
        "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
        "engine": {
            "window_rows": args.window,
            "block_size": BLOCK,
            "num_kv_blocks": args.kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "compile": False,
        },
    }
    path = folder / f"job-{grouping}-{shards}.yaml"
    path.write_text(yaml.safe_dump(job))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    wall = 0.0
    for i in range(shards):
        extra = ["--shard", f"{i}/{shards}"] if shards > 1 else []
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "batchgen", "run", str(path), "--quiet", *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall += time.perf_counter() - start
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    manifest = json.loads((out / "_SUCCESS").read_text())
    tokens = manifest["tokens"]
    return {
        "input": tokens["input"],
        "cached": tokens["cached"],
        "computed": tokens["input"] - tokens["cached"],
        "parts": manifest["parts"],
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=40)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--openings-per-doc", type=int, default=6)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--kv-blocks", type=int, default=96, help="KV pool in blocks of 16 tokens")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--shards", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    docs = documents(args.docs, args.openings_per_doc)
    with tempfile.TemporaryDirectory(prefix="batchgen-prefix-groups-") as tmp:
        folder = Path(tmp)
        data = write_input(folder, docs, args.questions, args.seed)
        total, ideal = ideal_computed(pq.read_table(data, columns=["prompt"]).column(0).to_pylist())
        doc_blocks = ideal // BLOCK
        result: dict[str, Any] = {
            "rows": args.docs * args.questions,
            "prompt_tokens": total,
            "ideal_computed": ideal,
            "kv_pool_blocks": args.kv_blocks,
            "kv_pool_share_of_documents": round(args.kv_blocks / max(doc_blocks, 1), 3),
            "window_rows": args.window,
            "runs": {},
        }
        for shards in args.shards:
            for grouping in ("none", "auto"):
                got = run_job(folder, data, grouping, shards, args)
                got["over_ideal"] = round(got["computed"] / ideal, 3)
                result["runs"][f"{grouping}/{shards}"] = got
                print(json.dumps({f"{grouping}/{shards}": got}), file=sys.stderr)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
