"""Which attention kernel the engine runs, and the call into torch's paged varlen kernel.

- "varlen": torch's FlashAttention-2 (`varlen_attn` with `block_table=`/`seqused_k=`), every chunk
  in one call per layer straight from the pool. Needs CUDA (sm >= 8.0), fp16/bf16, blocks a
  multiple of 256, head dim a multiple of 8 and <= 256, no soft-capping.
- "sdpa": gather + torch SDPA, the exact fallback for everything else.
- "triton": the triton backend's own kernel, named here so every backend is reported alike.
The choice is a pure function (`choose_attention_path`), so CPU tests cover every branch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch
from transformers import PretrainedConfig

from batchgen.engine.attention.metadata import FlashMetadata

try:
    from torch.nn.attention.varlen import varlen_attn as _torch_varlen_attn
except ImportError:  # torch < 2.10 has no varlen module
    _torch_varlen_attn = None  # type: ignore[assignment]

# The kernel call; a CPU test swaps in a reference implementation of the same contract.
VARLEN_ATTN: Callable[..., Any] | None = _torch_varlen_attn

VARLEN: Final = "varlen"
SDPA: Final = "sdpa"
TRITON: Final = "triton"
VARLEN_BLOCK_MULTIPLE = 256  # FlashAttention-2's paged kernel: "block size must be divisible by 256"
SMALL_BLOCK_SIZE = 16  # the block size wherever the varlen kernel does not apply
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
MIN_COMPUTE_CAPABILITY = (8, 0)  # FlashAttention-2: Ampere or newer
MAX_HEAD_DIM = 256

AttentionPathName = Literal["varlen", "sdpa", "triton"]


@dataclass(frozen=True)
class KernelSupport:
    """What this torch build and device offer the varlen path (see detect_support)."""

    varlen_paged: bool  # varlen_attn exists and takes block_table= and seqused_k= (torch >= 2.12)
    compute_capability: tuple[int, int] | None  # the CUDA device's; None off CUDA


@dataclass(frozen=True)
class AttentionChoice:
    path: AttentionPathName
    reason: str  # why, in words: logged at load and recorded by the GPU check


TRITON_CHOICE = AttentionChoice(TRITON, "attention_backend triton: its paged kernel reads the pool in place")


def varlen_signature_ok(fn: Callable[..., Any] | None) -> bool:
    """Whether `fn` (torch's varlen_attn) takes the paged-KV arguments this engine passes."""
    if fn is None:
        return False
    params = inspect.signature(fn).parameters
    return all(name in params for name in ("block_table", "seqused_k", "enable_gqa", "window_size", "scale"))


def detect_support(device: torch.device) -> KernelSupport:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return KernelSupport(varlen_paged=varlen_signature_ok(_torch_varlen_attn), compute_capability=capability)


def has_softcap(config: PretrainedConfig) -> bool:
    """Whether the model soft-caps its attention logits (Gemma 2): the varlen kernel cannot."""
    return getattr(config.get_text_config(), "attn_logit_softcapping", None) is not None


def choose_attention_path(
    device_type: str,
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    softcap: bool,
    support: KernelSupport,
) -> AttentionChoice:
    """The paged varlen kernel where everything allows it, else gather + SDPA; with the reason."""
    if device_type != "cuda":
        return AttentionChoice(SDPA, f"device {device_type} (the varlen kernel is CUDA only)")
    if dtype not in VARLEN_DTYPES:
        return AttentionChoice(SDPA, f"{dtype} (the varlen kernel needs float16 or bfloat16)")
    if not support.varlen_paged:
        return AttentionChoice(
            SDPA, f"torch {torch.__version__}: varlen_attn has no block_table=/seqused_k= (torch >= 2.12 has)"
        )
    cc = support.compute_capability
    if cc is None or cc < MIN_COMPUTE_CAPABILITY:
        return AttentionChoice(SDPA, f"compute capability {cc} (FlashAttention-2 needs >= 8.0)")
    if softcap:
        return AttentionChoice(SDPA, "attention logit soft-capping (varlen_attn has no softcap argument)")
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return AttentionChoice(SDPA, f"head_dim {head_dim} (the varlen kernel needs a multiple of 8, <= 256)")
    if block_size % VARLEN_BLOCK_MULTIPLE:
        return AttentionChoice(SDPA, f"block_size {block_size} (the varlen kernel needs a multiple of 256)")
    return AttentionChoice(VARLEN, "CUDA, half precision, block_size a multiple of 256: paged varlen, no gather")


def default_block_size(
    device_type: str, dtype: torch.dtype, head_dim: int, softcap: bool, support: KernelSupport
) -> int:
    """256 where that makes the varlen kernel apply, else 16 (finer prefix sharing, less waste)."""
    choice = choose_attention_path(device_type, dtype, VARLEN_BLOCK_MULTIPLE, head_dim, softcap, support)
    return VARLEN_BLOCK_MULTIPLE if choice.path == VARLEN else SMALL_BLOCK_SIZE


def varlen_paged_attention(
    meta: FlashMetadata,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q: torch.Tensor,
    scaling: float,
    window: int | None,
) -> torch.Tensor:
    """q [H, T, D] (packed, chunk order), caches [num_blocks, block_size, KVH, D] -> [T, H, D]; every
    chunk attends causally (bottom-right aligned) over the first seqused_k[i] tokens of its pages."""
    if VARLEN_ATTN is None:
        raise RuntimeError("the varlen attention path needs torch.nn.attention.varlen (torch >= 2.12)")
    return VARLEN_ATTN(
        q.transpose(0, 1),  # [T, H, D]
        k_cache,
        v_cache,
        meta.cu_seqlens_q.int(),  # staged as int64 with the step's other metadata; the kernel takes int32
        meta.cu_seqlens_k.int(),
        meta.max_seqlen_q,
        meta.max_seqlen_k,
        scale=scaling,
        # transformers' sliding window (keys with q - kv < window) as FlashAttention's (left, right)
        window_size=(-1, 0) if window is None else (window - 1, 0),
        enable_gqa=q.shape[0] != k_cache.shape[2],
        seqused_k=meta.seqused_k.int(),
        block_table=meta.block_tables.int(),
    )
