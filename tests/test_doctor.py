"""`batchgen doctor` tells the truth about the native kernels: what a run would find (cached with its
path, not built, or unavailable and why), and `--build` fails when a kernel could not be built, so
a Dockerfile's `RUN batchgen doctor --build` fails with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchgen.errors import EXIT_KERNELS_UNBUILT


def _doctor(tmp_path: Path, *args: str, **env: str) -> tuple[int, dict[str, Any], str]:
    """(exit code, the kernels by name, stderr) of `batchgen doctor --json` with an empty kernel cache."""
    environ = {**os.environ, "BATCHGEN_CACHE_DIR": str(tmp_path / "cache"), **env}
    environ.pop("BATCHGEN_NATIVE", None)
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=600,
    )
    kernels = {k["name"]: k for k in json.loads(done.stdout)["kernels"]} if done.stdout else {}
    return done.returncode, kernels, done.stderr


@pytest.mark.parametrize("no_compiler", ["bad_cc", "no_cc_on_path"])
def test_without_a_compiler_kernels_are_unavailable_not_cached(tmp_path: Path, no_compiler: str) -> None:
    if no_compiler == "bad_cc":
        env = {"CC": "/nope/cc", "CXX": "/nope/c++"}
    else:  # a PATH holding python alone
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "python").symlink_to(sys.executable)
        env = {"PATH": str(tmp_path / "bin"), "CC": "", "CXX": ""}  # (an empty $CC is no compiler)
    code, kernels, stderr = _doctor(tmp_path, **env)
    assert code == 0, stderr
    assert {k["state"] for k in kernels.values()} == {"unavailable"}, kernels
    why = "/nope/cc cannot run" if no_compiler == "bad_cc" else "no C compiler found"
    assert why in kernels["attention"]["why"] and why in kernels["argmax"]["why"]
    assert "the native linear kernel is unavailable" in kernels["batchgen_linear_op"]["why"]


def test_build_fails_when_kernels_cannot_be_built(tmp_path: Path) -> None:
    code, kernels, stderr = _doctor(tmp_path, "--build", BATCHGEN_NATIVE_CFLAGS="-mfoo")
    assert code == EXIT_KERNELS_UNBUILT, stderr
    assert {k["state"] for k in kernels.values()} == {"unavailable"}, kernels
    assert "5 of 5 kernels could not be built" in stderr and "-mfoo" in kernels["argmax"]["why"]


def test_a_cached_kernel_is_reported_with_its_path(tmp_path: Path) -> None:
    environ = {**os.environ, "BATCHGEN_CACHE_DIR": str(tmp_path / "cache")}
    build = "from batchgen.engine.cpu import native; print(native.function('batchgen_row_argmax') is not None)"
    done = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, env=environ, timeout=600)
    assert done.stdout.strip() == "True", done.stderr
    code, kernels, stderr = _doctor(tmp_path)
    assert code == 0, stderr
    built = list((tmp_path / "cache" / "kernels").glob("batchgen_argmax-*.so"))
    assert kernels["argmax"]["state"] == "cached" and kernels["argmax"]["path"] == str(built[0])
    assert kernels["attention"]["state"] == "not built" and kernels["attention"]["path"] == ""
