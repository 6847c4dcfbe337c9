"""The native kernels as an AVX2-only CPU builds them (-mno-avx512f), on whatever CPU runs the tests.

Why: the kernels were tuned on AVX-512 hosts, and the CI machine may have AVX-512 too, so the code
that AVX2-only CPUs (Zen 2/3, many cloud instances) compile, with its own tile counts, would
otherwise never run here. The libraries are built with BATCHGEN_NATIVE_CFLAGS=-mno-avx512f into a
cache of their own, once per test run (the avx2_build fixture), checked to hold no 512-bit register;
then the kernels' exactness tests and greedy parity with transformers through them run in a process
that loads that build.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from batchgen.engine.cpu import native

from .conftest import Avx2Build

pytestmark = pytest.mark.slow  # builds (a wheel, a venv, the kernels) in tens of seconds

REPO = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/engine/test_native.py::test_kernel_equals_attention_over_each_rows_own_positions",
    "tests/engine/test_native_linear.py::test_the_kernel_is_f_linear_in_float64_within_rounding",
    "tests/engine/test_native_linear.py::test_the_bf16_twin_is_f_linear_in_float64_within_bf16_rounding",
    "tests/engine/test_parity.py::test_greedy_parity_native_linears",
    "tests/engine/test_packed_linear.py::test_the_kernel_exists_exactly_where_the_cpu_computes_bf16",
]


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the build's instructions")
def test_an_avx2_build_holds_no_avx512_instruction(avx2_build: Avx2Build) -> None:
    code = (
        "from batchgen.engine.cpu import native as n; print(*(n.STATES[k].path for k in n.LIBRARIES if n.library(k)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=avx2_build.env(), capture_output=True, text=True, check=True
    )
    paths = done.stdout.split()
    assert len(paths) == len(native.LIBRARIES), done.stderr
    for path in paths:
        listing = subprocess.run(["objdump", "-d", path], capture_output=True, text=True, check=True).stdout
        assert "zmm" not in listing, f"{path} uses 512-bit registers"


def test_the_kernels_are_exact_and_greedy_parity_holds_on_an_avx2_build(avx2_build: Avx2Build) -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS]
    done = subprocess.run(command, cwd=REPO, env=avx2_build.env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
    built = list((avx2_build.cache / "kernels").glob("batchgen_*.so"))
    assert {p.name.split("-")[0] for p in built} >= {f"batchgen_{n}" for n in native.LIBRARIES}  # its own build ran
