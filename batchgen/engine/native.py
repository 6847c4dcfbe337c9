"""Native CPU kernels: built from csrc/ with the system C compiler on first use, cached, loaded with ctypes.

Why built here and not at install: the kernel is compiled for the machine it runs on
(-march=native: AVX-512 here, NEON on an ARM server) and against the OpenMP runtime torch has
already loaded (the same libgomp, so one thread pool). torch.compile on CPU needs the same
compiler, so a machine that compiles can also build this; one that cannot (or BATCHGEN_NATIVE=0)
runs the torch path instead, with one log line saying why.

The shared object is cached under $BATCHGEN_CACHE_DIR (default ~/.cache/batchgen), named by a
hash of the source, the flags, the compiler's version and this CPU's model and feature flags, so
a home directory shared by machines of different CPUs never loads a kernel built for another.
It is written to a temporary name and renamed, so processes building at once do not collide.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
# every source the library is built from: the decode attention, linears at decode sizes (few rows, tens of
# rows), greedy's argmax
_OTHER_SOURCES = ("skinny_linear.c", "wide_linear.c", "row_argmax.c")
SOURCES = (SOURCE, *(Path(__file__).parent / "csrc" / name for name in _OTHER_SOURCES))
DISABLE_ENV = "BATCHGEN_NATIVE"  # "0": never build or load native kernels
CACHE_ENV = "BATCHGEN_CACHE_DIR"
BASE_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
# tried in order: the CPU's own vector units first. Why the vector width: gcc's default on
# AVX-512 CPUs is 256-bit vectors; 512 made the kernel 12-30% faster where it is compute-bound
# (a shared prefix read from cache). x86 compilers take the flag for any CPU (without AVX-512 it
# changes nothing); others reject it and take the next set (a failed build is not cached, so
# such a machine retries that fast-failing compile once per process)
ARCH_FLAGS = [["-march=native", "-mprefer-vector-width=512"], ["-march=native"], ["-mcpu=native"], []]
LINK_FLAGS = ["-lm"]
TILE = 16  # positions per score tile (TILE in the source): the scratch rows are padded to it
MAX_G, MAX_D = 8, 256  # query heads per KV head, head dim: the source's limits
MAX_BLOCK = 4  # decodes the source attends together over a shared prefix: scratch rows for each

# batchgen_decode_attention's arguments, in the order of the source's A_* indices (one int64 array):
# those that hold for a step, those of the model's shapes (its first call), those of each layer
DECODE_ARGS = (
    "n", "threads", "kstride", "vstride", "cls", "row", "cap", "len", "shared",
    "kvh", "g", "d", "scratch", "scratch_stride",
    "q", "q_head", "q_token", "knew", "k_head", "k_token", "vnew", "v_head", "v_token",
    "kbase", "vbase", "window", "out", "kpool", "vpool", "slot", "pool_slots",
)  # fmt: skip
ARG = {name: i for i, name in enumerate(DECODE_ARGS)}

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@dataclass
class NativeKernels:
    """The loaded library; `decode_attention` is batchgen_decode_attention, `fill_row`
    batchgen_fill_row, `linear` batchgen_linear, `row_argmax` batchgen_row_argmax (see the sources)."""

    path: Path
    lib: ctypes.CDLL

    def __post_init__(self) -> None:
        count = self.lib.batchgen_decode_attention_args
        count.restype = _I64
        if count() != len(DECODE_ARGS):  # why: a source and this module out of step would misread memory
            raise RuntimeError(f"{self.path} takes {count()} arguments, this module names {len(DECODE_ARGS)}")
        fn = self.lib.batchgen_decode_attention
        fn.restype = _I64
        fn.argtypes = [_PTR, ctypes.c_float]
        self.decode_attention = fn
        fill = self.lib.batchgen_fill_row  # a decode row's context out of the pool (decode_native.fill_row)
        fill.restype = _I64
        fill.argtypes = [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64]
        self.fill_row = fill
        exp = self.lib.batchgen_exp_nonpositive  # the kernel's softmax exp, for the tests
        exp.restype = None
        exp.argtypes = [_I64, _PTR, _PTR]
        self.exp_nonpositive = exp
        linear = self.lib.batchgen_linear  # y = x @ w^T (+ bias) at decode sizes (native_linear)
        linear.restype = _I64
        linear.argtypes = [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64]
        self.linear = linear
        argmax = self.lib.batchgen_row_argmax  # each row's first maximum, and NaN rows (sampler, greedy)
        argmax.restype = _I64
        argmax.argtypes = [_I64, _I64, _PTR, _I64, _PTR, _I64]
        self.row_argmax = argmax


_LOADED: list[NativeKernels | None] = []  # once per process


def load() -> NativeKernels | None:
    """The native kernels, built if needed; None (logged once) where they cannot be."""
    if not _LOADED:
        _LOADED.append(_load())
    return _LOADED[0]


def _load() -> NativeKernels | None:
    if os.environ.get(DISABLE_ENV) == "0":
        logger.info("native CPU kernels off (%s=0): decode attention runs on torch ops", DISABLE_ENV)
        return None
    compiler = find_compiler("CC", "cc", "gcc")
    if compiler is None:
        logger.warning("no C compiler found (cc, gcc or $CC): decode attention runs on torch ops")
        return None
    try:
        path = _build(compiler)
        return NativeKernels(path, ctypes.CDLL(str(path)))
    # AttributeError: a library without one of the symbols native kernels need
    except (OSError, subprocess.SubprocessError, RuntimeError, AttributeError) as exc:
        logger.warning("native CPU kernels unavailable (%s): decode attention runs on torch ops", exc)
        return None


def find_compiler(env: str, *names: str) -> str | None:
    """$env when it is set, else the first of `names` found on the PATH (None: none is)."""
    return os.environ.get(env) or next((found for name in names if (found := shutil.which(name))), None)


def _build(compiler: str) -> Path:
    """The kernel library, compiled from SOURCES into the cache (or found there)."""
    return build("batchgen_kernels", SOURCES, compiler, [BASE_FLAGS + arch for arch in ARCH_FLAGS], LINK_FLAGS)


def build(
    name: str, sources: Sequence[Path], compiler: str, flag_sets: Sequence[list[str]], link: list[str], key: bytes = b""
) -> Path:
    """A shared library from `sources`, cached by their content, the flags, the compiler's version,
    this CPU and `key` (what else the build depends on); the first flag set that builds wins."""
    source = b"\0".join(path.read_bytes() for path in sources)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    errors = []
    for flags in flag_sets:
        digest = hashlib.sha256(b"\0".join([source, " ".join(flags + link).encode(), version.encode(), _cpu_id(), key]))
        target = _cache_dir() / f"{name}-{digest.hexdigest()[:20]}.so"
        if target.is_file():
            return target
        error = _compile(compiler, sources, flags, link, target)
        if error is None:
            logger.info("built %s: %s", name, target)
            return target
        errors.append(error)
    raise RuntimeError(f"{compiler} could not build {', '.join(p.name for p in sources)}: {errors[-1]}")


def _compile(compiler: str, sources: Sequence[Path], flags: list[str], link: list[str], target: Path) -> str | None:
    """Build into a temporary file beside `target`, then rename it there; the error text on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, sources), "-o", tmp, *link], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "batchgen") / "kernels"


def _cpu_id() -> bytes:
    """What -march=native depends on: the machine, and on Linux the CPU's model and feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    lines.append(line)
                if line == "\n" and lines:
                    break  # the first CPU describes them all
    except OSError:
        pass
    return (platform.machine() + "".join(lines)).encode()


def cpu_vendor() -> str | None:
    """The x86 CPU's maker as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD, ...); None elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def threads() -> int:
    """OpenMP threads a kernel call may use: torch's intra-op setting, as every torch op does."""
    return torch.get_num_threads()
