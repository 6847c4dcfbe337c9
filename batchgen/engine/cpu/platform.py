"""CpuPlatform: the CPU's answers to the device questions (api/platform), from this room's parts.

Attention `auto` is "cpu"; linears and greedy take the native kernels where measured faster;
threads follow the machine's load. compile `auto` is on wherever a C++ compiler is found (workload
(a) 15% faster on the demo model; benchmarks/RESULTS.md, fourth pass).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import torch

from batchgen.engine.api.platform import CompilePolicy, GreedyIds, Platform, StepHook, check_backend_name
from batchgen.engine.cpu import choice_cache, front, host, native, native_linear
from batchgen.engine.cpu.argmax import native_greedy_ids
from batchgen.engine.cpu.heap import keep_freed_memory
from batchgen.engine.cpu.threads import ThreadedCompile, ThreadGovernor
from batchgen.engine.triton import support as triton_support


class CpuPlatform(Platform):
    def attention_backend(self, setting: str) -> str:
        check_backend_name(setting)
        if setting == "auto":
            return "cpu"
        if setting == "triton":  # only under Triton's interpreter (for tests)
            triton_support.check_device(self.device)
        return setting

    def compiles_by_default(self) -> bool:
        return any(shutil.which(name) for name in (os.environ.get("CXX") or "c++", "g++", "clang++"))

    def compile_policy(self) -> CompilePolicy:
        return ThreadedCompile()

    def prepare_process(self) -> None:
        keep_freed_memory()

    def install_kernels(self, model: torch.nn.Module, dtype: torch.dtype) -> int:
        return native_linear.install_native_linears(model, self.device, dtype)

    def greedy_ids(self) -> GreedyIds | None:
        return native_greedy_ids

    def step_hook(self) -> StepHook:
        return ThreadGovernor()

    def facts(self, build: bool = False) -> dict[str, Any]:
        """The host, its compilers and each native kernel's state; with `build`, the missing kernels built first."""
        if build:
            native.load()
            native.function("batchgen_row_argmax")
            front.load()
            native_linear.load_op()  # builds the linear library, then its operator
        return {
            "host": host.describe(),
            "compilers": {"c": _compiler("CC", "cc", "gcc"), "c++": _compiler("CXX", "c++", "g++")},
            "cache_dir": str(native.cache_dir()),
            "native_cflags": " ".join(native.extra_flags()),
            "native_cflags_env": native.FLAGS_ENV,
            "kernels": [_kernel_state(name) for name in native.KERNELS],
            "measured_choices": choice_cache.measured_choices(),
        }

    def pending_kernels(self) -> tuple[list[str], str]:
        """The native kernels a first engine would build now, and how long that takes."""
        return native.pending(), native.BUILD_SECONDS

    def forget_measured(self) -> int:
        return choice_cache.forget_choices()


def _kernel_state(name: str) -> dict[str, Any]:
    done = native.state(name)
    return {"name": name, "state": done.state, "path": str(done.path or ""), "why": done.reason}


def _compiler(env: str, *names: str) -> dict[str, str | None]:
    path = native.find_compiler(env, *names)
    if path is None:
        return {"path": None, "version": None}
    try:
        version = native.compiler_version(path).splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        version = None
    return {"path": path, "version": version}
