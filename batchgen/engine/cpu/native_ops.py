"""Torch operators in C++ (csrc/*_op.cpp), built against this torch on first use and loaded into it.

Why C++ operators at all: from a compiled graph a call through a Python custom op costs ~13 us,
through a C++ one ~3 us, and a decode step makes one call per linear layer (native_linear) and
one per attention layer (attention_front). Each operator's source registers its CPU kernel for
a schema defined in Python and exports a setup function that takes a native kernel's address
(one of native.py's libraries, loaded with ctypes), so the operator and the ctypes callers share
one copy of the kernels. Built with the C++ compiler into native.py's cache, keyed by this torch's
version; each operator on its own, so one that cannot be built loses only itself.
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
from pathlib import Path

import torch

from batchgen.engine.cpu import native

logger = logging.getLogger(__name__)

HEADERS = (native.CSRC / "decode_args.h",)  # included by the operators: part of what their builds are keyed by
# each operator's source, by the name its library is built and reported under
OPERATORS = {
    "batchgen_attention_op": native.CSRC / "attention_op.cpp",
    "batchgen_linear_op": native.CSRC / "linear_op.cpp",
}

_NEEDS = {"batchgen_attention_op": "attention", "batchgen_linear_op": "linear"}  # the C library each calls
NO_CXX_COMPILER = "no C++ compiler found (c++, g++ or $CXX)"


def load_op(name: str, source: Path, what: str, needs: str) -> ctypes.CDLL | None:
    """The operator library built from `source` and loaded into torch (its ctypes handle, for the
    setup call); None, logged with `what` falls back to, where the kernel library `needs` or a C++
    compiler is missing or the build fails."""
    if native.library(needs) is None:  # None: switched off or unbuildable, logged there
        native.STATES[name] = native.BuildState(name, "unavailable", reason=f"the native {needs} kernel is not loaded")
        return None
    compiler = native.find_compiler("CXX", "c++", "g++")
    if compiler is None:
        refuse(name, f"{NO_CXX_COMPILER}: {what}")
        return None
    try:
        path = native.build(name, (source,), compiler, [_flags()], _link(), _key())
        torch.ops.load_library(str(path))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        refuse(name, f"{exc}: {what}")
        return None


def refuse(name: str, reason: str) -> None:
    native.STATES[name] = native.BuildState(name, "unavailable", reason=reason)
    logger.warning("%s unavailable (%s)", name, reason)


def _key() -> bytes:
    """What an operator's build depends on besides its source and flags: torch and the shared header."""
    return torch.__version__.encode() + b"".join(header.read_bytes() for header in HEADERS)


def _operator_state(name: str) -> native.BuildState:
    """Operator `name` as a run would find it, without building (see native.cached_state): it
    needs the C library it calls and a C++ compiler that runs."""
    needs = _NEEDS[name]
    library = state(needs)
    if library.state == "unavailable":
        return native.BuildState(name, "unavailable", reason=f"the native {needs} kernel is unavailable")
    compiler = native.find_compiler("CXX", "c++", "g++")
    if compiler is None:
        return native.BuildState(name, "unavailable", reason=NO_CXX_COMPILER)
    try:
        target = native.cache_targets(name, (OPERATORS[name],), compiler, [_flags()], _link(), _key())[0]
    except (OSError, subprocess.SubprocessError) as exc:
        return native.BuildState(name, "unavailable", reason=f"the C++ compiler {compiler} cannot run: {exc}")
    return native.BuildState(name, "cached", target) if target.is_file() else native.BuildState(name, "not built")


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return ["-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]


def _link() -> list[str]:
    from torch.utils import cpp_extension

    dirs = cpp_extension.library_paths()
    return [*(f"-L{d}" for d in dirs), *(f"-Wl,-rpath,{d}" for d in dirs), "-lc10", "-ltorch_cpu"]


KERNELS = (*native.LIBRARIES, *OPERATORS)  # every kernel: the C libraries, then the operators that call them


def state(name: str) -> native.BuildState:
    """What became of kernel `name` in this process; where it has not been loaded yet, without
    building anything: off (BATCHGEN_NATIVE=0), cached, or not built."""
    if name in native.STATES:
        return native.STATES[name]
    if os.environ.get(native.DISABLE_ENV) == "0":
        return native.BuildState(name, "off", reason=f"{native.DISABLE_ENV}=0")
    return native.cached_state(name) if name in native.LIBRARIES else _operator_state(name)


def pending() -> list[str]:
    """The kernels a CPU engine would build before its first step (empty: all cached, or switched off)."""
    return [name for name in KERNELS if state(name).state == "not built"]
