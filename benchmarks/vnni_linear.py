"""A bf16 linear on a weight packed once for vdpbf16ps, against oneDNN's bf16 linear and the float32 engine's best.

    nice .venv/bin/python benchmarks/vnni_linear.py [--rows 16 32 64] [--variant NR MR KC ...] > vnni.json
    .venv/bin/python benchmarks/vnni_linear.py --table vnni.json     # the markdown table of RESULTS.md

Why: issue 46's third pass found a bf16 decode step to be 66-89% matmul, and oneDNN's bf16 linear at
16-64 rows at 9-31% of the machine's bf16 peak (benchmarks/bf16_limit.py). This times
csrc/vnni_linear_bf16.c (the weight packed at load into pairs interleaved by output column, MR x NR
register tiles of vdpbf16ps, float32 accumulation) built at one or more tile shapes, beside torch's
bf16 F.linear (oneDNN), the engine's bf16 skinny kernel, torch's float32 F.linear and the engine's
float32 native linear, on each shape's weights read from memory (copies totalling COLD_BYTES cycled,
as a model's step reads them), interleaved rounds, best of each; and the 4096^3 bf16 matmul peak at the
start and end of the same run. Each kernel variant is first checked against torch's float32 matmul of
the same bf16 inputs. Needs AVX512-BF16 (exits saying so elsewhere).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import peak

SOURCE = Path(__file__).resolve().parent.parent / "batchgen" / "engine" / "cpu" / "csrc" / "vnni_linear_bf16.c"
SHAPES = [(1024, 1024), (1024, 4096), (4096, 1024), (2048, 8192), (4096, 4096), (4096, 14336)]  # (in, out)
COLD_BYTES = 96 << 20
ROUNDS = 7
_P, _I = ctypes.c_void_p, ctypes.c_int64


def build(nr: int, mr: int, kc: int, folder: Path) -> ctypes.CDLL:
    """The kernel at one tile shape (NR columns, MR rows, KC pairs a chunk)."""
    out = folder / f"vnni_{nr}_{mr}_{kc}.so"
    flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-fPIC", "-shared"]
    subprocess.run(
        ["cc", *flags, f"-DNR={nr}", f"-DMR={mr}", f"-DKC={kc}", str(SOURCE), "-o", str(out)],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(out))
    lib.batchgen_vnni_packed_size.restype, lib.batchgen_vnni_packed_size.argtypes = _I, [_I, _I]
    lib.batchgen_vnni_pack.restype, lib.batchgen_vnni_pack.argtypes = _I, [_I, _I, _P, _P, _I]
    lib.batchgen_vnni_linear.restype = _I
    lib.batchgen_vnni_linear.argtypes = [_I, _I, _I, _P, _I, _P, _P, _P, _I, _I]
    return lib


def pack(lib: ctypes.CDLL, w: torch.Tensor) -> torch.Tensor:
    """w [n, k] bf16 -> its packed copy (flat bf16)."""
    n, k = w.shape
    out = torch.empty(lib.batchgen_vnni_packed_size(n, k), dtype=torch.bfloat16)
    assert lib.batchgen_vnni_pack(n, k, w.data_ptr(), out.data_ptr(), torch.get_num_threads()) == 0
    return out


def vnni(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """out [m, n] (bf16, or float32) = x [m, k] @ w^T."""
    m, k = x.shape
    y_float = int(out.dtype == torch.float32)
    threads = torch.get_num_threads()
    args = (x.data_ptr(), x.stride(0), packed.data_ptr(), None, out.data_ptr(), y_float, threads)
    rc = lib.batchgen_vnni_linear(m, n, k, *args)
    assert rc == 0
    return out


def check(lib: ctypes.CDLL) -> float:
    """Worst relative error against float32 matmul of the same bf16 inputs over odd shapes."""
    worst = 0.0
    gen = torch.Generator().manual_seed(1)
    for m, k, n in [(1, 1, 1), (5, 7, 33), (17, 1023, 100), (65, 600, 129), (3, 4096, 64), (64, 2049, 70)]:
        x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
        ref = x.float() @ w.float().T
        got = vnni(lib, x, pack(lib, w), n, torch.empty(m, n))
        scale = ref.abs().max().clamp_min(1e-6)
        worst = max(worst, float((got - ref).abs().max() / scale))
    return worst


def time_calls(calls: dict[str, tuple[Callable[[], Any], int]]) -> dict[str, float]:
    best = dict.fromkeys(calls, float("inf"))
    for call, _ in calls.values():
        call()
    for _ in range(ROUNDS):
        for key, (call, count) in calls.items():
            began = time.perf_counter()
            call()
            best[key] = min(best[key], (time.perf_counter() - began) / count)
    return best


def shape_row(libs: dict[str, ctypes.CDLL], m: int, k: int, n: int, native: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    x32, w32 = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) / k**0.5
    copies = max(2, COLD_BYTES // (4 * n * k))
    x16, w16 = x32.bfloat16(), [w32.bfloat16() for _ in range(copies)]
    calls: dict[str, tuple[Callable[[], Any], int]] = {"onednn_bf16": (lambda: [F.linear(x16, w) for w in w16], copies)}
    for name, lib in libs.items():
        packs = [pack(lib, w) for w in w16]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        calls[name] = (lambda lib=lib, packs=packs, out=out: [vnni(lib, x16, p, n, out) for p in packs], copies)
    w32s = [w32.clone() for _ in range(max(2, copies // 2))]
    calls["torch_fp32"] = (lambda: [F.linear(x32, w) for w in w32s], len(w32s))
    if native:
        from batchgen.engine.cpu.native_linear import EVERY_BUCKET

        op = torch.ops.batchgen.linear
        calls["native_fp32"] = (lambda: [op(x32, w, None, EVERY_BUCKET) for w in w32s], len(w32s))
        calls["native_bf16"] = (lambda: [op(x16, w, None, EVERY_BUCKET) for w in w16], copies)
    with torch.inference_mode():
        best = time_calls(calls)
    flops = 2.0 * m * k * n
    row: dict[str, Any] = {"rows": m, "in": k, "out": n, "copies": copies}
    row.update({f"{key}_gflops": round(flops / t / 1e9, 1) for key, t in best.items()})
    return row


def _peaks() -> dict[str, float]:
    return {f"{dtype}_gflops": peak.matmul_gflops(dtype) for dtype in ("bfloat16", "float32")}


def table(run: dict[str, Any]) -> str:
    """GFLOP/s of each side and the packed kernel's ratios, against the run's higher bf16 peak."""
    top = max(run["peak_start"]["bfloat16_gflops"], run["peak_end"]["bfloat16_gflops"])
    lines = [
        "| rows x in -> out | oneDNN bf16 | skinny bf16 | packed bf16 | best fp32 | packed / oneDNN "
        "| packed / best bf16 before | packed / best fp32 | packed, % of bf16 peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in run["rows"]:
        ours = next(v for k, v in r.items() if k.startswith("vnni_"))
        onednn, skinny = r["onednn_bf16_gflops"], r.get("native_bf16_gflops", 0.0)
        fp32 = max(r["torch_fp32_gflops"], r.get("native_fp32_gflops", 0.0))
        lines.append(
            f"| {r['rows']} x {r['in']} -> {r['out']} | {onednn} | {skinny} | {ours} | {fp32} | {ours / onednn:.2f}x "
            f"| {ours / max(onednn, skinny):.2f}x | {ours / fp32:.2f}x | {100 * ours / top:.0f}% |"
        )
    return "\n".join(lines)


def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--variant", type=int, nargs=3, action="append", metavar=("NR", "MR", "KC"))
    parser.add_argument("--table", type=Path, help="print the table of a run's JSON and exit")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        sys.exit(0)
    variants = args.variant or [[64, 6, 256]]
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "load_start": os.getloadavg()}
    out["peak_start"] = _peaks()
    from batchgen.engine.cpu import native_linear

    native = native_linear.load_op()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {f"vnni_{nr}x{mr}_kc{kc}": build(nr, mr, kc, Path(tmp)) for nr, mr, kc in variants}
        out["max_rel_error"] = {name: check(lib) for name, lib in libs.items()}
        out["rows"] = [shape_row(libs, m, k, n, native) for m in args.rows for k, n in SHAPES]
    out["peak_end"] = _peaks()
    out["load_end"] = os.getloadavg()
    return out


if __name__ == "__main__":
    json.dump(main(), sys.stdout, indent=1)
    print()
