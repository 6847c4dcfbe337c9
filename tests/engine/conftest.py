"""Tiny random-weight models of every supported architecture, saved like real HF folders.

2 layers, hidden 64, a 256-token word-level tokenizer whose id 0 is EOS; weights drawn with a large
initializer range so greedy logits are not near-tied. Sliding windows are small (<= 48) so that
300-token prompts really exercise them. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchgen.engine.cpu import native
from testkit.tiny_models import save_random_model, tiny_configs
from tests.shared_setup import once


def failing_compiler(folder: Path, name: str) -> Path:
    """An executable `folder/name` that answers --version and fails every build with "fake: no luck"."""
    fake = folder / name
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fake 1.0; exit 0; }\necho "fake: no luck" >&2; exit 1\n')
    fake.chmod(0o755)
    return fake


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "gpt_neox"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model("llama") -> folder of a saved tiny model of that architecture (built once)."""
    built: dict[str, Path] = {}
    configs = tiny_configs()

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = save_random_model(configs[arch], tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


@dataclass(frozen=True)
class Avx2Build:
    """The kernels as an AVX2-only CPU builds them (-mno-avx512f), in a kernel cache of their own."""

    cache: Path
    picky: dict[str, list[object]]  # by library: [loaded, state] when a compiler failing on linear built them

    def env(self) -> dict[str, str]:
        """The environment of a process that loads this build."""
        return {**os.environ, native.FLAGS_ENV: "-mno-avx512f", native.CACHE_ENV: str(self.cache), DISABLE: "1"}


DISABLE = native.DISABLE_ENV
# loads linear, argmax, attention in that order; prints {library: [loaded, state, why]}
_LOAD_ALL = (
    "import json; from batchgen.engine.cpu import native as n; "
    "print(json.dumps({k: [n._load(n.LIBRARIES[k]) is not None, n.STATES[k].state, n.STATES[k].reason] "
    "for k in ('linear', 'argmax', 'attention')}))"
)


@pytest.fixture(scope="session")
def avx2_build(tmp_path_factory: pytest.TempPathFactory) -> Avx2Build:
    """One AVX2 build per test run, for every test that reads it, whichever xdist worker runs them.

    Why so: compiling the attention library is most of a build (~30 s), and test_native_avx2.py's two
    tests and test_native.py's picky-compiler test each made their own. Its first compiler is a
    wrapper that fails on the linear sources (as GCC 11 once did on a GCC 12 builtin): what it made
    of each library is `picky`; the real compiler then builds linear. The C++ operators take no
    $BATCHGEN_NATIVE_CFLAGS, so where this run's own cache holds them (same sources, flags, compiler
    and torch: the same file name) they are copied in rather than compiled again."""

    def build(folder: Path) -> None:
        cache = folder / "cache"
        real = shutil.which("cc") or shutil.which("gcc")
        assert real is not None, "no C compiler on this machine: CI must have one"
        picky = folder / "picky-cc"
        picky.write_text(
            f'#!/bin/sh\ncase "$*" in *linear.c*) echo "error: no luck" >&2; exit 1;; esac\nexec {real} "$@"\n'
        )
        picky.chmod(0o755)
        env = Avx2Build(cache, {}).env()
        for compiler in (str(picky), real):  # the picky one first: it must build, not find, what it can
            done = subprocess.run(
                [sys.executable, "-c", _LOAD_ALL], env={**env, "CC": compiler}, capture_output=True, text=True
            )
            assert done.returncode == 0, done.stderr[-3000:]
            if compiler == str(picky):
                (folder / "picky.json").write_text(done.stdout)
        _copy_operators(cache / "kernels")

    folder = once(tmp_path_factory, "avx2-build", build)
    return Avx2Build(folder / "cache", json.loads((folder / "picky.json").read_text()))


def _copy_operators(kernels: Path) -> None:
    """The C++ operators this run's own kernel cache holds, copied under the same names into `kernels`."""
    for name in native.OPERATORS:
        built = native.state(name).path
        if built is not None and built.is_file():
            shutil.copy2(built, kernels / built.name)
