"""The prefix plan's pass over a big input: peak memory and time of `make_cut` (tokenize every
prompt, key it, sort the keys in bounded memory, cut the parts) on a synthetic input of N rows
(documents x questions, shuffled), against the memory of the process before the pass.

    python benchmarks/plan_memory.py --rows 1000000 --out /tmp/plan_memory.json

`--run-mb` sets the sort's in-memory run size (key_sort.RUN_BYTES), so spilling shows at any N.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "sample_data" / "demo-model"
WORDS = "once upon a time there was a little girl named lily who loved to play in the park with her dog".split()


def rss_mb() -> float:
    """This process's peak resident memory so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_input(path: Path, rows: int, questions: int, seed: int) -> None:
    rng = random.Random(seed)
    writer = None
    chunk = 100_000
    order = list(range(rows))
    rng.shuffle(order)
    for start in range(0, rows, chunk):
        ids = order[start : start + chunk]
        prompts = []
        for i in ids:
            d, q = divmod(i, questions)
            doc_rng = random.Random(d)
            doc = " ".join(doc_rng.choice(WORDS) for _ in range(60))
            prompts.append(f"Document {d}: {doc}\nQuestion {q}: what happens?")
        table = pa.table({"id": [f"r{i}" for i in ids], "prompt": prompts})
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    if writer is not None:
        writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--run-mb", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from batchgen.inputs import key_sort
    from batchgen.inputs.reading import open_inputs
    from batchgen.job.spec import load_job
    from batchgen.run.layout import make_cut

    key_sort.RUN_BYTES = args.run_mb << 20
    with tempfile.TemporaryDirectory(prefix="batchgen-plan-memory-") as tmp:
        data = Path(tmp) / "in.parquet"
        write_input(data, args.rows, args.questions, 0)
        job = {
            "model": {"path": str(MODEL)},
            "input": {"path": str(data), "id_column": "id"},
            "output": {"path": str(Path(tmp) / "out")},
            "engine": {"window_rows": args.window, "block_size": 16},
        }
        (Path(tmp) / "job.yaml").write_text(yaml.safe_dump(job))
        spec = load_job(Path(tmp) / "job.yaml")
        files = open_inputs(spec.input.path, ["prompt"])
        from batchgen.inputs.prepare import load_tokenizer

        load_tokenizer(MODEL)  # (imports transformers: counted in the baseline, not the pass)
        before = rss_mb()
        start = time.perf_counter()
        cut = make_cut(spec, files)
        seconds = time.perf_counter() - start
        peak = rss_mb()
    sizes = [b - a for a, b in zip(cut.starts, cut.starts[1:])]
    result = {
        "rows": args.rows,
        "parts": len(sizes),
        "run_mb": args.run_mb,
        "seconds": round(seconds, 1),
        "rows_per_s": round(args.rows / seconds),
        "rss_before_mb": round(before),
        "rss_peak_mb": round(peak),
        "pass_growth_mb": round(peak - before),
        "plan_arrays_mb": round(cut.rows.nbytes / (1 << 20), 1),
        "part_rows_min_max": [min(sizes), max(sizes)],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
