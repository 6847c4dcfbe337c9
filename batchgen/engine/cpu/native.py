"""Native CPU kernels: three small C libraries, and two C++ torch operators that call them, each built
on its own by the system's compiler, cached, loaded.

Why built on the machine and not shipped compiled: each kernel is compiled for the CPU it runs on
(-march=native: AVX-512 on one host, AVX2 on the next, NEON on an ARM server) and against the
OpenMP runtime torch has already loaded (the same libgomp, so one thread pool). The sources ship
in the wheel; `batchgen doctor --build` builds them ahead of a job (a Dockerfile, a cluster's
bootstrap), else the first job that needs one builds it (logged, with the expected time).

Why three libraries: a compiler that cannot build one (an old GCC, a missing intrinsic) loses only
that one; the others still load. Each falls back to torch's own path with one log line saying why:
  attention  decode attention over per-sequence rows, float32 and bf16 (decode_attention.c): torch ops otherwise
  argmax     greedy's argmax and NaN flag in one pass (row_argmax.c): torch.max otherwise
  linear     float32 and bf16 linears at decode sizes (skinny_linear.c, wide_linear.c, skinny_linear_bf16.c,
             and vnni_linear_bf16.c on a weight packed for AVX512-BF16): torch's BLAS otherwise,
             and even when built, only at the shapes where it measured faster (native_linear)

Why C++ operators (csrc/*_op.cpp, OPERATORS): from a compiled graph a call through a Python custom
op costs ~13 us, through a C++ one ~3 us, and a decode step makes one call per linear layer
(native_linear) and one per attention layer (front). Each registers its CPU kernel for a schema
defined in Python and takes the address of its C library's kernel (loaded here with ctypes), so the
operator and the ctypes callers share one copy of the kernels; it is built by the C++ compiler
against this torch (its version is part of the key) and loaded into torch.

Each shared object is cached under $BATCHGEN_CACHE_DIR (default ~/.cache/batchgen), named by a
hash of its sources, the flags, the compiler's version and this CPU's model and feature flags, so
a home directory shared by machines of different CPUs never loads a kernel built for another.
It is written to a temporary name and renamed, so processes building at once do not collide.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchgen.engine.cpu import host

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
DISABLE_ENV = "BATCHGEN_NATIVE"  # "0": never build or load native kernels
CACHE_ENV = "BATCHGEN_CACHE_DIR"
NO_C_COMPILER = "no C compiler found (cc, gcc or $CC)"
NO_CXX_COMPILER = "no C++ compiler found (c++, g++ or $CXX)"
FLAGS_ENV = "BATCHGEN_NATIVE_CFLAGS"  # extra compiler flags, after the others (e.g. -mno-avx512f: an AVX2 build)
BASE_FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
# tried in order: the CPU's own vector units first. Why the vector width: gcc's default on
# AVX-512 CPUs is 256-bit vectors; 512 made the attention kernel 12-30% faster where it is
# compute-bound (a shared prefix read from cache). x86 compilers take the flag for any CPU (without
# AVX-512 it changes nothing); others reject it and take the next set (a failed build is not
# cached, so such a machine retries that fast-failing compile once per process)
ARCH_FLAGS = [["-march=native", "-mprefer-vector-width=512"], ["-march=native"], ["-mcpu=native"], []]
LINK_FLAGS = ["-lm"]
TILE = 16  # positions per score tile (TILE in decode_attention.c): the scratch rows are padded to it
MAX_G, MAX_D = 8, 256  # query heads per KV head, head dim: decode_attention.c's limits
MAX_BLOCK = 4  # decodes decode_attention.c attends together over a shared prefix: scratch rows for each
# what a first build costs (three C libraries and two C++ operators): ~20 s on an idle 2-core Zen 4,
# 113 s on an idle 2-core AVX2 EPYC (the attention library 70 s of it)
BUILD_SECONDS = "20-150 s, longer on a busy machine"

# batchgen_decode_attention's arguments, in the order of the source's A_* indices (one int64 array):
# those that hold for a step, those of the model's shapes (its first call), those of each layer.
# The library names them too (batchgen_decode_attention_arg_names): a library whose names differ is refused.
DECODE_ARGS = (
    "n", "threads", "kstride", "vstride", "cls", "row", "cap", "len", "shared", "classes", "rows",
    "kvh", "g", "d", "scratch", "scratch_stride",
    "q", "q_head", "q_token", "knew", "k_head", "k_token", "vnew", "v_head", "v_token",
    "kbase", "vbase", "window", "out", "kpool", "vpool", "slot", "pool_slots",
)  # fmt: skip
ARG = {name: i for i, name in enumerate(DECODE_ARGS)}

CFunction = Any  # a ctypes function pointer (its class is private to ctypes)
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_FILL: list[type] = [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64]
_ATTEND: list[type] = [_PTR, ctypes.c_float]
_EXP: list[type] = [_I64, _PTR, _PTR]
_ARGMAX: list[type] = [_I64, _I64, _PTR, _I64, _PTR, _I64]
_LINEAR: list[type] = [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64]
# Every C entry point: its library and its arguments (each returns an int64, but exp_nonpositive, unread).
# A `_bf16` name is the bfloat16 twin of the one before it (function(name, torch.bfloat16)).
SYMBOLS: dict[str, tuple[str, list[type]]] = {
    "batchgen_decode_attention": ("attention", _ATTEND),
    "batchgen_decode_attention_bf16": ("attention", _ATTEND),
    "batchgen_fill_row": ("attention", _FILL),
    "batchgen_fill_row_bf16": ("attention", _FILL),
    "batchgen_exp_nonpositive": ("attention", _EXP),  # the softmax's exp, for the tests
    "batchgen_row_argmax": ("argmax", _ARGMAX),
    "batchgen_row_argmax_bf16": ("argmax", _ARGMAX),
    "batchgen_linear": ("linear", _LINEAR),
    "batchgen_linear_bf16": ("linear", _LINEAR),
    # vnni_linear_bf16.c: a bf16 linear on weights packed for AVX512-BF16 (packed_linear); vnni_linear()
    "batchgen_vnni_panel": ("linear", []),
    "batchgen_vnni_packed_size": ("linear", [_I64, _I64]),
    "batchgen_vnni_pack": ("linear", [_I64, _I64, _PTR, _PTR, _I64]),
    "batchgen_vnni_linear": ("linear", [*_LINEAR[:-1], _I64, _I64]),
}
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the element types the kernels read


@dataclass(frozen=True)
class Library:
    """One kernel library: its sources (under csrc/) and what runs where it cannot be built."""

    name: str
    sources: tuple[str, ...]
    fallback: str
    headers: tuple[str, ...] = ()  # included by the sources: part of what a build is keyed by
    needs: str | None = None  # set: a C++ operator, loaded into torch, calling this C library's kernels

    @property
    def paths(self) -> list[Path]:
        return [CSRC / source for source in self.sources]

    @property
    def target(self) -> str:
        """The name its builds are cached under."""
        return self.name if self.needs else f"batchgen_{self.name}"

    def key(self) -> bytes:
        """What a build depends on besides its sources and flags: its headers (an operator's: and torch)."""
        headers = b"\0".join((CSRC / header).read_bytes() for header in self.headers)
        return headers if self.needs is None else torch.__version__.encode() + headers

    def toolchain(self) -> tuple[str | None, str, list[list[str]], list[str]]:
        """(its compiler or None, why none, the flag sets tried in order, the link flags): a C
        library's sets with the user's $BATCHGEN_NATIVE_CFLAGS last in each; an operator's against this torch."""
        if self.needs is None:
            flag_sets = [BASE_FLAGS + arch + extra_flags() for arch in ARCH_FLAGS]
            return find_compiler("CC", "cc", "gcc"), NO_C_COMPILER, flag_sets, LINK_FLAGS
        from torch.utils import cpp_extension

        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        flags = ["-O2", "-std=c++20", "-fPIC", "-shared", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
        dirs = cpp_extension.library_paths()
        link = [*(f"-L{d}" for d in dirs), *(f"-Wl,-rpath,{d}" for d in dirs), "-lc10", "-ltorch_cpu"]
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        return find_compiler("CXX", "c++", "g++"), NO_CXX_COMPILER, [flags + includes], link


LIBRARIES = {
    lib.name: lib
    for lib in (
        Library(
            "attention",
            ("decode_attention.c", "decode_attention_bf16.c"),
            "decode attention runs on torch ops",
            ("decode_args.h", "bf16.h"),
        ),
        Library("argmax", ("row_argmax.c", "row_argmax_bf16.c"), "greedy's argmax runs on torch.max", ("bf16.h",)),
        Library(
            "linear",
            ("skinny_linear.c", "wide_linear.c", "skinny_linear_bf16.c", "vnni_linear_bf16.c"),
            "linear layers run on torch's BLAS",
            ("bf16.h",),
        ),
    )
}
OPERATORS = {
    lib.name: lib
    for lib in (
        Library("batchgen_attention_op", ("attention_op.cpp",), "attention goes through the Python op",
                ("decode_args.h",), "attention"),
        Library("batchgen_linear_op", ("linear_op.cpp",), "linear layers run on torch's BLAS",
                ("decode_args.h",), "linear"),
    )
}  # fmt: skip
KERNELS = {**LIBRARIES, **OPERATORS}  # every kernel: the C libraries, then the operators that call them


@dataclass
class BuildState:
    """What became of one library in this process (for `batchgen doctor` and the logs)."""

    name: str
    state: str  # "off" (BATCHGEN_NATIVE=0), "cached", "built", "not built" (not loaded yet) or "unavailable"
    path: Path | None = None
    reason: str = ""
    seconds: float = 0.0


STATES: dict[str, BuildState] = {}  # by library name, once loaded (or refused) in this process
_HANDLES: dict[str, ctypes.CDLL | None] = {}
_FUNCTIONS: dict[str, CFunction | None] = {}


def _twin(symbol: str, dtype: torch.dtype) -> str:
    if dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"the native kernels read float32 or bfloat16, not {dtype}")
    return symbol + "_bf16" if dtype == torch.bfloat16 else symbol


def names_differ(lib: ctypes.CDLL, symbol: str, ours: tuple[str, ...]) -> tuple[str, ...] | None:
    """The names `lib`'s `symbol` gives a memory layout where they differ from `ours` (None: the same)."""
    fn = getattr(lib, symbol)
    fn.restype = ctypes.c_char_p
    theirs = tuple(fn().decode().lower().split())
    return None if theirs == ours else theirs


@functools.cache
def load() -> Path | None:
    """The decode attention library, built if needed (once per process), its argument names checked
    against DECODE_ARGS (decode_attention.c) and its entry points bound: its path, which names the
    choices measured with it (cpu/backend.native_wins); None (logged once) where it cannot be."""
    lib = library("attention")
    if lib is None:
        return None
    path = STATES["attention"].path
    try:
        mismatch = names_differ(lib, "batchgen_decode_attention_arg_names", DECODE_ARGS)
        why = f"{path} takes arguments {mismatch}, this module names {DECODE_ARGS}" if mismatch else None
    except AttributeError as exc:  # a library built from other sources
        why = f"{path} does not list its arguments ({exc})"
    if why is not None:  # why: a source and this module out of step would misread memory
        refuse("attention", why)
        return None
    bound = [function(s) for s, (owner, _) in SYMBOLS.items() if owner == "attention"]  # a missing one: refused
    return STATES["attention"].path if None not in bound else None


def attention(symbol: str, dtype: torch.dtype) -> CFunction:
    """Entry point `symbol` of the attention library (its bf16 twin for bfloat16), where load() took it."""
    fn = function(symbol, dtype) if load() is not None else None
    if fn is None:
        raise RuntimeError("the native attention kernels are not loaded (see the log)")
    return fn


def function(symbol: str, dtype: torch.dtype = torch.float32) -> CFunction | None:
    """C entry point `symbol` of SYMBOLS (its bf16 twin for bfloat16), from its library built and
    loaded once per process; None where that cannot be built, or lacks the symbol (refused then)."""
    symbol = _twin(symbol, dtype)
    if symbol not in _FUNCTIONS:
        owner = SYMBOLS[symbol][0]
        lib = library(owner)
        try:
            _FUNCTIONS[symbol] = None if lib is None else _bound(lib, symbol)
        except AttributeError:  # a library built from other sources: refused, as a failed build is
            refuse(owner, f"{symbol} is missing from it")
            _FUNCTIONS[symbol] = None
    return _FUNCTIONS[symbol]


def vnni_linear() -> dict[str, CFunction] | None:
    """csrc/vnni_linear_bf16.c's entry points by short name (panel, packed_size, pack, linear), or None
    where the linear library cannot be built or was built without AVX512-BF16 (its panel is 0)."""
    names = ("panel", "packed_size", "pack", "linear")
    found = {name: function(f"batchgen_vnni_{name}") for name in names}
    ready = {name: fn for name, fn in found.items() if fn is not None}
    return ready if len(ready) == len(names) and ready["panel"]() > 0 else None


def _bound(lib: ctypes.CDLL, symbol: str) -> CFunction:
    fn = getattr(lib, symbol)
    fn.restype, fn.argtypes = _I64, SYMBOLS[symbol][1]
    return fn


def library(name: str) -> ctypes.CDLL | None:
    """Library `name` of KERNELS, built (or found in the cache) and loaded once per process;
    None, logged once with what runs instead, where it is switched off or cannot be built."""
    if name not in _HANDLES:
        _HANDLES[name] = _load(KERNELS[name])
    return _HANDLES[name]


def _load(lib: Library) -> ctypes.CDLL | None:
    if lib.needs is not None and library(lib.needs) is None:  # None: switched off or unbuildable, logged there
        STATES[lib.name] = BuildState(lib.name, "unavailable", reason=f"the native {lib.needs} kernel is not loaded")
        return None
    if os.environ.get(DISABLE_ENV) == "0":
        STATES[lib.name] = BuildState(lib.name, "off", reason=f"{DISABLE_ENV}=0")
        logger.info("native %s kernel off (%s=0): %s", lib.name, DISABLE_ENV, lib.fallback)
        return None
    compiler, missing, flag_sets, link = lib.toolchain()
    if compiler is None:
        refuse(lib.name, missing)
        return None
    try:
        path = build(lib, compiler, flag_sets, link)
        if lib.needs is not None:
            torch.ops.load_library(str(path))
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        refuse(lib.name, str(exc))
        return None


def refuse(name: str, reason: str) -> None:
    """Kernel `name` cannot be used (`reason`): recorded, and logged with what runs instead."""
    STATES[name] = BuildState(name, "unavailable", reason=reason)
    logger.warning("native %s kernel unavailable (%s): %s", name, reason, KERNELS[name].fallback)


def extra_flags() -> list[str]:
    return shlex.split(os.environ.get(FLAGS_ENV, ""))


def find_compiler(env: str, *names: str) -> str | None:
    """$env when it is set, else the first of `names` found on the PATH (None: none is)."""
    return os.environ.get(env) or next((found for name in names if (found := shutil.which(name))), None)


def build(lib: Library, compiler: str, flag_sets: Sequence[list[str]], link: list[str]) -> Path:
    """`lib` as a shared library, cached by its sources, the flags, the compiler's version, this CPU
    and its key; the first flag set that builds wins. STATES records how it went."""
    started = time.monotonic()
    errors: list[str] = []
    for target in cache_targets(lib, compiler, flag_sets, link):
        if target.is_file():
            STATES[lib.name] = BuildState(lib.name, "cached", target)
            return target
        error = _compile(compiler, lib.paths, flag_sets[len(errors)], link, target)
        if error is None:
            seconds = time.monotonic() - started
            STATES[lib.name] = BuildState(lib.name, "built", target, seconds=seconds)
            logger.info("built %s in %.1f s: %s", lib.target, seconds, target)
            return target
        errors.append(error)
    raise RuntimeError(f"{compiler} could not build {', '.join(lib.sources)}: {errors[-1]}")


def cache_targets(lib: Library, compiler: str, flag_sets: Sequence[list[str]], link: list[str]) -> list[Path]:
    """Where each flag set's build of `lib` is cached (one path per flag set, in order)."""
    source = b"\0".join(path.read_bytes() for path in lib.paths)
    version, key = compiler_version(compiler), lib.key()
    targets = []
    for flags in flag_sets:
        digest = hashlib.sha256(b"\0".join([source, " ".join(flags + link).encode(), version.encode(), _cpu_id(), key]))
        targets.append(cache_dir() / f"{lib.target}-{digest.hexdigest()[:20]}.so")
    return targets


@functools.lru_cache(maxsize=8)
def compiler_version(compiler: str) -> str:
    """`compiler --version`'s output (once per process: every cache lookup asks for it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def state(name: str) -> BuildState:
    """What became of kernel `name` of KERNELS in this process; where it has not been loaded yet,
    what a run would find, without building: off (BATCHGEN_NATIVE=0), `cached` (with its path), `not
    built`, or `unavailable` where a run could not build it (no compiler, or one that cannot run; an
    operator: its C library unavailable)."""
    if name in STATES:
        return STATES[name]
    if os.environ.get(DISABLE_ENV) == "0":
        return BuildState(name, "off", reason=f"{DISABLE_ENV}=0")
    lib = KERNELS[name]
    if lib.needs is not None and state(lib.needs).state == "unavailable":
        return BuildState(name, "unavailable", reason=f"the native {lib.needs} kernel is unavailable")
    compiler, missing, flag_sets, link = lib.toolchain()
    if compiler is None:
        return BuildState(name, "unavailable", reason=missing)
    try:
        targets = cache_targets(lib, compiler, flag_sets, link)
    except (OSError, subprocess.SubprocessError) as exc:
        return BuildState(name, "unavailable", reason=f"the compiler {compiler} cannot run: {exc}")
    found = next((target for target in targets if target.is_file()), None)
    return BuildState(name, "cached", found) if found is not None else BuildState(name, "not built")


def pending() -> list[str]:
    """The kernels a CPU engine would build before its first step (empty: all cached, or switched off)."""
    return [name for name in KERNELS if state(name).state == "not built"]


def _compile(compiler: str, sources: Sequence[Path], flags: list[str], link: list[str], target: Path) -> str | None:
    """Build into a temporary folder beside `target`, then rename the library there; the error text on failure.

    Why a library of several sources is compiled one object per source, at once, then linked: they
    are independent translation units, and the attention library's two (float32 and bf16) took 55 s
    each at -O3 on a 2-core AMD EPYC, one after the other in a single call: a first job waited for
    both. Where cores are free the build now takes about as long as its slowest source."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as work:
        inputs = [str(source) for source in sources]
        if len(sources) > 1:
            inputs = [os.path.join(work, f"{i}-{source.stem}.o") for i, source in enumerate(sources)]
            calls = [[compiler, *flags, "-c", str(src), "-o", obj] for src, obj in zip(sources, inputs)]
            with ThreadPoolExecutor(max_workers=min(len(calls), host.usable_cpus())) as pool:
                failed = next((done for done in pool.map(_run, calls) if done.returncode != 0), None)
            if failed is not None:
                return _first_error(failed.stderr) or f"exit {failed.returncode}"
        built = os.path.join(work, target.name)
        done = _run([compiler, *flags, *inputs, "-o", built, *link])
        if done.returncode != 0:
            return _first_error(done.stderr) or f"exit {done.returncode}"
        os.replace(built, target)
        return None


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def _first_error(stderr: str) -> str:
    """The compiler's first error line (the last line is often only a count of them)."""
    lines = stderr.strip().splitlines()
    return next((line for line in lines if "error" in line), lines[-1] if lines else "")


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return (Path(root) if root else Path.home() / ".cache" / "batchgen") / "kernels"


def _cpu_id() -> bytes:
    """What -march=native depends on: the machine, and on Linux the CPU's model and feature flags."""
    keep = ("model name", "flags", "Features", "CPU part")
    lines = "".join(line + "\n" for line in host.cpuinfo_lines() if line.startswith(keep))
    return (platform.machine() + lines).encode()


def threads() -> int:
    """OpenMP threads a kernel call may use: torch's intra-op setting, as every torch op does."""
    return torch.get_num_threads()
