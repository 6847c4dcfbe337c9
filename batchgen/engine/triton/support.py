"""Where the Triton backend can run, and whether Triton is set up to interpret its kernels on the CPU.

On the CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1), which must be set
before triton is first imported (triton.language's own functions are jit-decorated then, and
transformers imports triton): in practice, in the process's starting environment.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
# What auto needs to pick the backend on CUDA: bfloat16 tensor-core dots (Ampere or newer).
MIN_AUTO_CAPABILITY = (8, 0)
_DECORATED = ("JITFunction", "InterpretedFunction")


@functools.cache
def triton_importable() -> bool:
    """Whether `import triton` works here (it may be missing, or broken for this torch build)."""
    try:
        importlib.import_module("triton.language")
    except Exception:  # why broad: a mismatched build fails with RuntimeError or OSError, not just ImportError
        return False
    return True


def interpreting() -> bool:
    """Whether Triton's interpreter is asked for (TRITON_INTERPRET=1, the spelling every triton 3.x accepts)."""
    return os.environ.get(INTERPRET_ENV) == "1"


def prefers_triton(device: torch.device) -> bool:
    """What `attention_backend: auto` reads off the CPU: a CUDA device of compute capability >= 8.0
    where triton imports."""
    if device.type != "cuda" or not torch.cuda.is_available() or not triton_importable():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_AUTO_CAPABILITY


def check_device(device: torch.device) -> None:
    """A ValueError that says why the triton backend cannot run on `device` (on the CPU: without its
    interpreter, or with triton imported before it was asked for); None where it can."""
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"attention_backend 'triton' runs on CUDA, not on {device.type}")
    if device.type == "cpu" and not interpreting():
        raise ValueError(
            "attention_backend 'triton' runs on CUDA; on the CPU only under Triton's interpreter "
            f"({INTERPRET_ENV}=1 in the environment the process starts with; slow, for tests). "
            "Use 'cpu' or 'torch' on the CPU"
        )
    if not triton_importable():
        raise ValueError("attention_backend 'triton' needs the triton package: pip install 'batchgen[cuda]'")
    if device.type == "cpu" and not interpreter_ready():
        raise ValueError(
            f"attention_backend 'triton' on the CPU: {INTERPRET_ENV}=1 was set after triton was first imported "
            "(transformers' model classes import it); set it in the environment the process starts with"
        )


def interpreter_ready() -> bool:
    """Whether triton.language's decorated functions and our kernels are all interpreted ones."""
    import triton.language as tl

    from batchgen.engine.triton import kernels

    decorated = [v for v in vars(tl).values() if type(v).__name__ in _DECORATED]
    decorated += [kernels.paged_attention_kernel, kernels.store_kv_kernel]
    return all(type(v).__name__ == "InterpretedFunction" for v in decorated)
