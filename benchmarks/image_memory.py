"""Peak memory of an image job: `batchgen run` over one part of N path images (noise JPEGs, which
compress badly, so their bytes weigh) on a tiny random LLaVA, as a child process whose peak RSS
is read from the OS; JSON on stdout. Pass another tree's root as --tree to measure it the same way
(the data and the job are made with this tree's testkit).

    .venv/bin/python benchmarks/image_memory.py --images 600                    # this tree
    .venv/bin/python benchmarks/image_memory.py --images 600 --tree /tmp/old   # an older checkout
    .venv/bin/python benchmarks/image_memory.py --engine max_decoded_pixels=1000000

What it shows: a part's path images are held as paths (no bytes, no open file) and a step decodes
at most engine.max_decoded_pixels; before those, a part held every image's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_data(work: Path, n: int, width: int, height: int) -> None:
    """The model folder, n JPEGs and a Parquet of (id, question, relative path)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from testkit.tiny_vision import save_tiny_vlm

    (work / "img").mkdir(parents=True)
    save_tiny_vlm("llava", work / "model")
    rng = np.random.default_rng(0)
    for i in range(n):
        pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(work / "img" / f"{i}.jpg", quality=90)
    ids = [str(i) for i in range(n)]
    table = pa.table({"id": ids, "q": ["w5 w6"] * n, "image": [f"img/{i}.jpg" for i in range(n)]})
    pq.write_table(table, work / "q.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--size", default="1024x768", help="WIDTHxHEIGHT of each image")
    parser.add_argument("--tree", default=str(ROOT), help="the checkout whose batchgen runs the job")
    parser.add_argument("--engine", action="append", default=[], help="KEY=VALUE of the job's engine section")
    args = parser.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_data(work, args.images, width, height)
        engine = ", ".join(
            ["backend: native", f"window_rows: {args.images}", *(e.replace("=", ": ") for e in args.engine)]
        )
        (work / "job.yaml").write_text(
            f"model: {{path: {work}/model}}\n"
            f"input: {{path: {work}/q.parquet, prompt_column: q, image_column: image, id_column: id}}\n"
            f"output: {{path: {work}/out}}\nsampling: {{max_tokens: 4, temperature: 0.0}}\nengine: {{{engine}}}\n"
        )
        env = dict(os.environ, PYTHONPATH=args.tree)
        command = [
            sys.executable,
            "-c",
            "from batchgen.cli import main; main()",
            "run",
            str(work / "job.yaml"),
            "--quiet",
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        # why cwd: `python -c` puts the working directory first on sys.path, ahead of --tree
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=work)
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        on_disk = sum(p.stat().st_size for p in (work / "img").iterdir())
    print(json.dumps({
        "tree": args.tree, "images": args.images, "size": args.size, "engine": args.engine,
        "images_on_disk_mib": round(on_disk / 2**20), "exit_code": done.returncode,
        "peak_rss_mib": round(peak / 1024) if peak > before else None,
    }))  # fmt: skip
    if done.returncode:
        print(done.stderr[-2000:], file=sys.stderr)


if __name__ == "__main__":
    main()
