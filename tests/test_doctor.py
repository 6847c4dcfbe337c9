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
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.cpu.choice_cache import choice_path, read_choice, write_once
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


def test_measured_choices_are_listed_and_remeasure_forgets_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Choices stored the way the engine stores them (write_once) are listed per folder with when they
    were measured; `--remeasure` forgets every one (kernels stay), so the next engine measures again."""
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    for folder, key in [("linear-calibration", "8x8"), ("linear-calibration", "8x16"), ("argmax-bf16", "32")]:
        write_once(choice_path(folder, key), "mask", {"mask": 1})
    kernel = tmp_path / "cache" / "kernels" / "batchgen_argmax-0.so"
    kernel.write_bytes(b"")  # a kernel: never forgotten
    runner = CliRunner()
    listed = runner.invoke(main, ["doctor", "--json"])
    assert listed.exit_code == 0, listed.output
    choices = json.loads(listed.stdout)["measured_choices"]
    assert {folder: c["count"] for folder, c in choices.items()} == {"argmax-bf16": 1, "linear-calibration": 2}
    assert "measured      argmax-bf16 1, linear-calibration 2 (" in runner.invoke(main, ["doctor"]).stdout
    forgot = runner.invoke(main, ["doctor", "--remeasure"])
    assert forgot.exit_code == 0 and "forgot 3 measured choices" in forgot.stderr, forgot.output
    assert "measured      nothing yet" in forgot.stdout
    assert read_choice(choice_path("argmax-bf16", "32"), "mask") is None and kernel.exists()


def test_remeasure_that_cannot_remove_a_choice_says_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    stuck = tmp_path / "cache" / "kernels" / "linear-calibration" / "0.json"
    stuck.mkdir(parents=True)  # a folder where a choice would be: unlink fails, as on a read-only cache
    done = CliRunner().invoke(main, ["doctor", "--remeasure"])
    assert done.exit_code == 1 and f"--remeasure: cannot remove {stuck}" in done.stderr, done.output
