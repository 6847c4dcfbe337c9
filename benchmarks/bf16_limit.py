"""How much bf16 can gain over float32 on this CPU at all: the arithmetic limit, measured in one run.

    nice .venv/bin/python benchmarks/bf16_limit.py > limit.json

Three figures, each bf16 against float32 side by side, interleaved, best of several rounds (a busy
spell then hits both alike):
- the core's instructions (csrc/isa_peak.c: vfmadd231ps against vdpbf16ps on 512-bit registers,
  one thread, no memory traffic): the most any bf16 kernel can gain over a float32 one here;
- torch's 4096^3 matmul (the peak benchmarks/peak.py judges the engine against);
- the memory's read bandwidth (a decode step streams every weight once: bf16 halves those bytes);
- torch's linear and the engine's native linear kernels at the decode sizes of the sweep's shapes
  (rows = sequences decoding at once, each weight of the model, read from memory), which bound what
  a bf16 decode step can gain end to end over the float32 engine (which takes the faster of its two).
Why: the issue's 2.5x goal came from a Sapphire Rapids host whose AMX tiles multiply bf16 ~16x
faster than its float32 FMAs; AVX512-BF16 alone (AMD Zen 4) has no such unit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ISA_SOURCE = Path(__file__).parent / "csrc" / "isa_peak.c"
# (name, rows, in, out): the 4096^3 peak, then each linear of h1024 (32 rows), h2048 (32), h4096 (16)
LINEARS = [
    ("4096^3", 4096, 4096, 4096),
    ("h1024 qkvo 32x1024->1024", 32, 1024, 1024),
    ("h1024 gate/up 32x1024->4096", 32, 1024, 4096),
    ("h1024 down 32x4096->1024", 32, 4096, 1024),
    ("h1024 head 32x1024->16384", 32, 1024, 16384),
    ("h2048 q/o 32x2048->2048", 32, 2048, 2048),
    ("h2048 gate/up 32x2048->5632", 32, 2048, 5632),
    ("h2048 down 32x5632->2048", 32, 5632, 2048),
    ("h2048 head 32x2048->32768", 32, 2048, 32768),
    ("h4096 gate/up 16x4096->11008", 16, 4096, 11008),
    ("h4096 down 16x11008->4096", 16, 11008, 4096),
]
ROUNDS = 7


def isa_limit() -> dict[str, Any]:
    """isa_peak.c's figures (one thread), or why there are none (no compiler, no AVX512-BF16)."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "isa_peak"
        build = [os.environ.get("CC", "cc"), "-O2", "-mavx512f", "-mavx512bf16", "-o", str(binary), str(ISA_SOURCE)]
        try:
            subprocess.run(build, check=True, capture_output=True, timeout=120)
            out = subprocess.run([str(binary)], check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            return {"error": f"isa_peak not run: {exc}"}
    figures: dict[str, Any] = json.loads(out.stdout)
    return figures


COLD_BYTES = 96 << 20  # weights cycled per timing: more than the L3 (32 MiB here), as a model's are


def linear_ratios() -> list[dict[str, Any]]:
    """GFLOP/s of each of LINEARS: torch's linear and the engine's native kernel (batchgen::linear,
    every row bucket), each in float32 and bf16, interleaved rounds. The decode sizes cycle through
    copies of the weight (COLD_BYTES in all), so each call reads its weight from memory, as a model's
    step does; the 4096^3 product is compute-bound either way."""
    import torch
    from torch.nn import functional as F

    from batchgen.engine.cpu import native_linear

    native_op = native_linear.load_op()
    rows = []
    for name, m, k, n in LINEARS:
        gen = torch.Generator().manual_seed(0)
        x32, w32 = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
        copies = 1 if m == n else max(2, COLD_BYTES // (4 * n * k))
        calls: dict[str, Any] = {}
        for dtype in (torch.float32, torch.bfloat16):
            x, ws = x32.to(dtype), [w32.to(dtype).clone() for _ in range(copies)]
            tag = "float32" if dtype == torch.float32 else "bf16"
            calls[f"torch_{tag}"] = (lambda x=x, ws=ws: [F.linear(x, w) for w in ws], len(ws))
            if native_op and m != n:
                calls[f"native_{tag}"] = (lambda x=x, ws=ws: [_native(x, w) for w in ws], len(ws))
        best = dict.fromkeys(calls, float("inf"))
        for call, _ in calls.values():
            call()  # warm-up: oneDNN's kernel choice and packing
        for _ in range(ROUNDS):
            for key, (call, count) in calls.items():
                began = time.perf_counter()
                call()
                best[key] = min(best[key], (time.perf_counter() - began) / count)
        flops = 2.0 * m * k * n
        row: dict[str, Any] = {"linear": name, "weight_copies": copies}
        row.update({f"{key}_gflops": round(flops / t / 1e9, 1) for key, t in best.items()})
        f32 = min(t for key, t in best.items() if "float32" in key)
        bf16 = min(t for key, t in best.items() if "bf16" in key)
        row["best_bf16_over_best_float32"] = round(f32 / bf16, 2)
        rows.append(row)
    return rows


def _native(x: Any, w: Any) -> Any:
    """The engine's native linear (csrc/skinny_linear*.c, wide_linear.c) at every row count."""
    import torch

    from batchgen.engine.cpu.native_linear import EVERY_BUCKET

    return torch.ops.batchgen.linear(x, w, None, EVERY_BUCKET)


def read_bandwidth() -> float:
    """GB/s of reading 512 MiB (a float32 sum over it, all threads): what bounds a decode step's
    weight reads, which no dtype changes except by halving the bytes."""
    import torch

    big = torch.ones(128 << 20)  # 512 MiB
    big.sum()
    best = float("inf")
    for _ in range(ROUNDS):
        began = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - began)
    return round(big.numel() * 4 / best / 1e9, 1)


def main() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"threads": torch.get_num_threads(), "load_start": os.getloadavg()}
    out["isa"] = isa_limit()
    out["read_gb_s"] = read_bandwidth()
    out["torch_linear"] = linear_ratios()
    out["load_end"] = os.getloadavg()
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=1)
    print()
