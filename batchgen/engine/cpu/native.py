"""Native CPU kernels: three small C libraries, each built on its own by the system C compiler, cached, loaded.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchgen.engine.cpu import host

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
DISABLE_ENV = "BATCHGEN_NATIVE"  # "0": never build or load native kernels
CACHE_ENV = "BATCHGEN_CACHE_DIR"
NO_C_COMPILER = "no C compiler found (cc, gcc or $CC)"
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
# what a first build costs (three C libraries and two C++ operators): ~20 s on an idle 2-core machine
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

_I64 = ctypes.c_int64
CFunction = Any  # a ctypes function pointer (its class is private to ctypes)
_PTR = ctypes.c_void_p


@dataclass(frozen=True)
class Library:
    """One kernel library: its sources (under csrc/) and what runs where it cannot be built."""

    name: str
    sources: tuple[str, ...]
    fallback: str
    headers: tuple[str, ...] = ()  # included by the sources: part of what a build is keyed by

    @property
    def paths(self) -> list[Path]:
        return [CSRC / source for source in self.sources]

    def key(self) -> bytes:
        return b"\0".join((CSRC / header).read_bytes() for header in self.headers)


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


@dataclass
class BuildState:
    """What became of one library in this process (for `batchgen doctor` and the logs)."""

    name: str
    state: str  # "off" (BATCHGEN_NATIVE=0), "cached", "built" or "unavailable"
    path: Path | None = None
    reason: str = ""
    seconds: float = 0.0


STATES: dict[str, BuildState] = {}  # by library name, once loaded (or refused) in this process
_HANDLES: dict[str, ctypes.CDLL | None] = {}


@dataclass
class NativeKernels:
    """The attention library: `decode_attention` is batchgen_decode_attention, `fill_row`
    batchgen_fill_row (float32 rows), each with a bfloat16 twin (`_bf16`: decode_attention_bf16.c),
    `exp_nonpositive` the softmax's exp (for the tests); see decode_attention.c."""

    path: Path
    lib: ctypes.CDLL
    decode_attention: CFunction = field(init=False)
    fill_row: CFunction = field(init=False)
    decode_attention_bf16: CFunction = field(init=False)
    fill_row_bf16: CFunction = field(init=False)
    exp_nonpositive: CFunction = field(init=False)

    def __post_init__(self) -> None:
        names = self.lib.batchgen_decode_attention_arg_names
        names.restype = ctypes.c_char_p
        theirs = tuple(names().decode().lower().split())
        if theirs != DECODE_ARGS:  # why: a source and this module out of step would misread memory
            raise RuntimeError(f"{self.path} takes arguments {theirs}, this module names {DECODE_ARGS}")
        fill_args: list[type] = [_PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64]
        self.decode_attention = _fn(self.lib.batchgen_decode_attention, _I64, [_PTR, ctypes.c_float])
        self.fill_row = _fn(self.lib.batchgen_fill_row, _I64, fill_args)
        self.decode_attention_bf16 = _fn(self.lib.batchgen_decode_attention_bf16, _I64, [_PTR, ctypes.c_float])
        self.fill_row_bf16 = _fn(self.lib.batchgen_fill_row_bf16, _I64, fill_args)
        self.exp_nonpositive = _fn(self.lib.batchgen_exp_nonpositive, None, [_I64, _PTR, _PTR])

    def attention_for(self, dtype: torch.dtype) -> CFunction:
        """The decode attention for rows of `dtype` (float32 or bfloat16)."""
        return self.decode_attention_bf16 if _is_bf16(dtype) else self.decode_attention

    def fill_row_for(self, dtype: torch.dtype) -> CFunction:
        """The row fill for pools and rows of `dtype` (float32 or bfloat16)."""
        return self.fill_row_bf16 if _is_bf16(dtype) else self.fill_row


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the element types the attention kernels read


def _is_bf16(dtype: torch.dtype) -> bool:
    if dtype not in KERNEL_DTYPES:
        raise RuntimeError(f"native decode attention reads float32 or bfloat16, not {dtype}")
    return dtype == torch.bfloat16


def _fn(fn: CFunction, restype: type | None, argtypes: list[type]) -> CFunction:
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


_ATTENTION: list[NativeKernels | None] = []  # once per process


def load() -> NativeKernels | None:
    """The decode attention kernels, built if needed; None (logged once) where they cannot be."""
    if not _ATTENTION:
        lib = library("attention")
        kernels = None
        if lib is not None:
            try:
                kernels = NativeKernels(STATES["attention"].path or Path(), lib)
            except (RuntimeError, AttributeError) as exc:  # AttributeError: a symbol missing
                _refuse("attention", str(exc))
        _ATTENTION.append(kernels)
    return _ATTENTION[0]


def argmax() -> CFunction | None:
    """batchgen_row_argmax (csrc/row_argmax.c), or None where it cannot be built."""
    return _function("argmax", "batchgen_row_argmax", [_I64, _I64, _PTR, _I64, _PTR, _I64])


def argmax_bf16() -> CFunction | None:
    """batchgen_row_argmax_bf16 (csrc/row_argmax_bf16.c), or None where it cannot be built."""
    return _function("argmax", "batchgen_row_argmax_bf16", [_I64, _I64, _PTR, _I64, _PTR, _I64])


def linear() -> CFunction | None:
    """batchgen_linear (csrc/skinny_linear.c, wide_linear.c), or None where it cannot be built."""
    return _function("linear", "batchgen_linear", [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64])


def linear_bf16() -> CFunction | None:
    """batchgen_linear_bf16 (csrc/skinny_linear_bf16.c), or None where it cannot be built."""
    return _function("linear", "batchgen_linear_bf16", [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64])


def vnni_linear() -> dict[str, CFunction] | None:
    """csrc/vnni_linear_bf16.c's functions by short name (panel, packed_size, pack, linear), or None where
    the linear library cannot be built or was built without AVX512-BF16 (its panel is 0)."""
    specs: dict[str, list[type]] = {
        "panel": [],
        "packed_size": [_I64, _I64],
        "pack": [_I64, _I64, _PTR, _PTR, _I64],
        "linear": [_I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64],
    }
    found = {name: _function("linear", f"batchgen_vnni_{name}", argtypes) for name, argtypes in specs.items()}
    ready = {name: fn for name, fn in found.items() if fn is not None}
    return ready if len(ready) == len(specs) and ready["panel"]() > 0 else None


_FUNCTIONS: dict[str, CFunction | None] = {}


def _function(library_name: str, symbol: str, argtypes: list[type]) -> CFunction | None:
    if symbol not in _FUNCTIONS:
        lib = library(library_name)
        try:
            _FUNCTIONS[symbol] = None if lib is None else _fn(getattr(lib, symbol), _I64, argtypes)
        except AttributeError:  # a library built from other sources: refused, as a failed build is
            _refuse(library_name, f"{symbol} is missing from it")
            _FUNCTIONS[symbol] = None
    return _FUNCTIONS[symbol]


def library(name: str) -> ctypes.CDLL | None:
    """Library `name` of LIBRARIES, built (or found in the cache) and loaded once per process;
    None, logged once with what runs instead, where it is switched off or cannot be built."""
    if name not in _HANDLES:
        _HANDLES[name] = _load(LIBRARIES[name])
    return _HANDLES[name]


def _load(lib: Library) -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV) == "0":
        STATES[lib.name] = BuildState(lib.name, "off", reason=f"{DISABLE_ENV}=0")
        logger.info("native %s kernel off (%s=0): %s", lib.name, DISABLE_ENV, lib.fallback)
        return None
    compiler = find_compiler("CC", "cc", "gcc")
    if compiler is None:
        _refuse(lib.name, NO_C_COMPILER)
        return None
    try:
        path = build(f"batchgen_{lib.name}", lib.paths, compiler, c_flag_sets(), LINK_FLAGS, lib.key(), lib.name)
        return ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        _refuse(lib.name, str(exc))
        return None


def _refuse(name: str, reason: str) -> None:
    STATES[name] = BuildState(name, "unavailable", reason=reason)
    fallback = LIBRARIES[name].fallback if name in LIBRARIES else "torch's own path"
    logger.warning("native %s kernel unavailable (%s): %s", name, reason, fallback)


def c_flag_sets() -> list[list[str]]:
    """The flag sets a C kernel is built with, tried in order (the user's $BATCHGEN_NATIVE_CFLAGS last in each)."""
    return [BASE_FLAGS + arch + extra_flags() for arch in ARCH_FLAGS]


def extra_flags() -> list[str]:
    return shlex.split(os.environ.get(FLAGS_ENV, ""))


def find_compiler(env: str, *names: str) -> str | None:
    """$env when it is set, else the first of `names` found on the PATH (None: none is)."""
    return os.environ.get(env) or next((found for name in names if (found := shutil.which(name))), None)


def build(
    name: str,
    sources: Sequence[Path],
    compiler: str,
    flag_sets: Sequence[list[str]],
    link: list[str],
    key: bytes = b"",
    state: str | None = None,
) -> Path:
    """A shared library from `sources`, cached by their content, the flags, the compiler's version,
    this CPU and `key` (what else the build depends on); the first flag set that builds wins.
    `state`: the name under which STATES records how it went."""
    started = time.monotonic()
    errors: list[str] = []
    for target in cache_targets(name, sources, compiler, flag_sets, link, key):
        if target.is_file():
            STATES[state or name] = BuildState(state or name, "cached", target)
            return target
        flags = flag_sets[len(errors)]
        error = _compile(compiler, sources, flags, link, target)
        if error is None:
            seconds = time.monotonic() - started
            STATES[state or name] = BuildState(state or name, "built", target, seconds=seconds)
            logger.info("built %s in %.1f s: %s", name, seconds, target)
            return target
        errors.append(error)
    raise RuntimeError(f"{compiler} could not build {', '.join(p.name for p in sources)}: {errors[-1]}")


def cache_targets(
    name: str, sources: Sequence[Path], compiler: str, flag_sets: Sequence[list[str]], link: list[str], key: bytes = b""
) -> list[Path]:
    """Where each flag set's build of `sources` is cached (one path per flag set, in order)."""
    source = b"\0".join(path.read_bytes() for path in sources)
    version = compiler_version(compiler)
    targets = []
    for flags in flag_sets:
        digest = hashlib.sha256(b"\0".join([source, " ".join(flags + link).encode(), version.encode(), _cpu_id(), key]))
        targets.append(cache_dir() / f"{name}-{digest.hexdigest()[:20]}.so")
    return targets


@functools.lru_cache(maxsize=8)
def compiler_version(compiler: str) -> str:
    """`compiler --version`'s output (once per process: every cache lookup asks for it)."""
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


def is_cached(name: str) -> bool:
    """Whether C library `name` is already built for this machine (any of its flag sets), without building."""
    return cached_state(name).state == "cached"


def cached_state(name: str) -> BuildState:
    """C library `name` as a run would find it, without building: `cached` (with its path), `not
    built`, or `unavailable` where a run could not build it (no compiler, or one that cannot run)."""
    compiler = find_compiler("CC", "cc", "gcc")
    if compiler is None:
        return BuildState(name, "unavailable", reason=NO_C_COMPILER)
    lib = LIBRARIES[name]
    try:
        targets = cache_targets(f"batchgen_{name}", lib.paths, compiler, c_flag_sets(), LINK_FLAGS, lib.key())
    except (OSError, subprocess.SubprocessError) as exc:
        return BuildState(name, "unavailable", reason=f"the C compiler {compiler} cannot run: {exc}")
    found = next((target for target in targets if target.is_file()), None)
    return BuildState(name, "cached", found) if found is not None else BuildState(name, "not built")


def _compile(compiler: str, sources: Sequence[Path], flags: list[str], link: list[str], target: Path) -> str | None:
    """Build into a temporary file beside `target`, then rename it there; the error text on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, *map(str, sources), "-o", tmp, *link], capture_output=True, text=True, timeout=600
        )
        if done.returncode != 0:
            return _first_error(done.stderr) or f"exit {done.returncode}"
        os.replace(tmp, target)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
