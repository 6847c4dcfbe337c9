"""Peak memory of the runner's own path (read, validate, tokenize, order, write) as the number of
input rows grows. The engine is replaced by a trivial stand-in backend: its memory is fixed by
its KV pool, and this measures that everything around it stays bounded.

    .venv/bin/python benchmarks/runner_memory.py --rows 100000 1000000

Prints one JSON object: per row count, peak RSS (MiB), wall seconds, rows/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import resource, sys, time, json
from batchgen.run import part_work, runner
from batchgen.engine.api.outputs import CompletionOutput, RequestOutput
from batchgen.job.spec import load_job

class StandIn:
    name, max_model_len = "stand-in", 1024
    def resolved(self):
        return {"device": "cpu", "dtype": "stand-in"}
    def generate(self, prompts, params, on_output=None):
        outs = []
        for i, ids in enumerate(prompts):
            sample = CompletionOutput(index=0, text="ok", token_ids=[1, 2], finish_reason="length")
            out = RequestOutput(request_id=str(i), prompt=None, prompt_token_ids=ids, outputs=[sample])
            outs.append(out)
            if on_output: on_output(out)
        return outs

part_work.load_backend = lambda spec, tok: StandIn()  # the one load_engine calls
start = time.time()
summary = runner.JobRunner(load_job(sys.argv[1]), quiet=True).run()
print(json.dumps({"rows": summary.totals.rows, "wall_s": time.time() - start,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_input(path: Path, rows: int) -> None:
    # Short prompts written in row groups of 100k, like a typical export.
    writer = None
    for start in range(0, rows, 100_000):
        n = min(100_000, rows - start)
        table = pa.table(
            {
                "id": [f"row-{i}" for i in range(start, start + n)],
                "prompt": [f"Once upon a time there was a cat number {i % 977}." for i in range(start, start + n)],
            }
        )
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    writer.close()


def measure(rows: int, tmp: Path) -> dict[str, float]:
    data = tmp / f"in-{rows}.parquet"
    write_input(data, rows)
    job = tmp / f"job-{rows}.yaml"
    job.write_text(
        f"model: {{path: {REPO / 'sample_data/demo-model'}}}\n"
        f"input: {{path: {data}, prompt_column: prompt, id_column: id}}\n"
        f"output: {{path: {tmp / f'out-{rows}'}}}\n"
        "engine: {window_rows: 4096}\n"
    )
    done = subprocess.run([sys.executable, "-c", CHILD, str(job)], capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["rows_per_s"] = result["rows"] / result["wall_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {str(n): measure(n, Path(tmp)) for n in args.rows}
    print(json.dumps({"benchmark": "runner_memory", "window_rows": 4096, "results": results}, indent=2))


if __name__ == "__main__":
    main()
