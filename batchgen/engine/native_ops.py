"""Torch operators in C++ (csrc/*_op.cpp), built against this torch on first use and loaded into it.

Why C++ operators at all: from a compiled graph a call through a Python custom op costs ~13 us,
through a C++ one ~3 us, and a decode step makes one call per linear layer (native_linear) and
one per attention layer (attention_front). Each operator's source registers its CPU kernel for
a schema defined in Python and exports a setup function that takes a native kernel's address
(native.py's library, loaded with ctypes), so the operator and the ctypes callers share one copy
of the kernels. Built with the C++ compiler into native.py's cache, keyed by this torch's version.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
from pathlib import Path

import torch

from batchgen.engine import native

logger = logging.getLogger(__name__)


def load_op(name: str, source: Path, what: str) -> ctypes.CDLL | None:
    """The operator library built from `source` and loaded into torch (its ctypes handle, for the
    setup call); None, logged with `what` falls back to, where the kernels or a C++ compiler are
    missing or the build fails."""
    if native.load() is None:  # None: switched off or unbuildable, logged there
        return None
    compiler = native.find_compiler("CXX", "c++", "g++")
    if compiler is None:
        logger.warning("no C++ compiler found (c++, g++ or $CXX): %s", what)
        return None
    try:
        path = native.build(name, (source,), compiler, [_flags()], _link(), torch.__version__.encode())
        torch.ops.load_library(str(path))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        logger.warning("%s unavailable (%s): %s", name, exc, what)
        return None


def _flags() -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return ["-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes]


def _link() -> list[str]:
    from torch.utils import cpp_extension

    dirs = cpp_extension.library_paths()
    return [*(f"-L{d}" for d in dirs), *(f"-Wl,-rpath,{d}" for d in dirs), "-lc10", "-ltorch_cpu"]
