"""The gathered LoRA update on CUDA as Triton kernels (punica's BGMV idea): each token reads only
its own slot's A and B, where the torch path (lora/layer) multiplies every slot and masks.

Two launches per wrapped linear, for the whole step:
  shrink  grid (T,): v[t] = A[slot t] @ x[t]            ([R] per token, float32 accumulation)
  expand  grid (T, out / BLOCK_N): y[t] += B[slot t] @ v[t]   (in place on the base layer's output)
A token of slot -1 (the base model, padding) adds exactly nothing: its loads are masked to zero.
Products are multiply-and-sum in float32 (no tl.dot, so no TF32 rounding of float32 inputs).
Shapes match lora/layer: A [slots * R, in], B [out, slots * R] (scaling folded in).

On the CPU the kernels run under Triton's interpreter only (TRITON_INTERPRET=1, tests; see
engine/triton/support). Called through the custom op `batchgen::lora_add`, which torch.compile
treats as one opaque node (its fake implementation gives the shape).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # input features per shrink iteration
BLOCK_N = 64  # output features per expand program


@triton.jit
def lora_shrink_kernel(x_ptr, slots_ptr, a_ptr, v_ptr, in_features, R: tl.constexpr, RP: tl.constexpr,
                       BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t)
    r = tl.arange(0, RP)  # [RP]
    live = (r * 0 + slot) >= 0  # [RP] (a tensor: masks must be)
    acc = tl.zeros([RP], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK):
        k = k0 + tl.arange(0, BLOCK)  # [BLOCK]
        x = tl.load(x_ptr + t * in_features + k, mask=k < in_features, other=0.0).to(tl.float32)
        rows = slot * R + r  # [RP]
        a_mask = (r[:, None] < R) & live[:, None] & (k[None, :] < in_features)
        a = tl.load(a_ptr + rows[:, None] * in_features + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(v_ptr + t * RP + r, acc)


@triton.jit
def lora_expand_kernel(v_ptr, slots_ptr, b_ptr, y_ptr, out_features, width, R: tl.constexpr,
                       RP: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    slot = tl.load(slots_ptr + t)
    live = (n * 0 + slot) >= 0  # [BLOCK]
    r = tl.arange(0, RP)
    v = tl.load(v_ptr + t * RP + r)  # [RP] float32
    cols = slot * R + r
    b_mask = (n[:, None] < out_features) & live[:, None] & (r[None, :] < R)
    b = tl.load(b_ptr + n[:, None] * width + cols[None, :], mask=b_mask, other=0.0).to(tl.float32)  # [BLOCK, RP]
    delta = tl.sum(b * v[None, :], axis=1)  # [BLOCK]
    y_mask = n < out_features
    y = tl.load(y_ptr + t * out_features + n, mask=y_mask, other=0.0)
    tl.store(y_ptr + t * out_features + n, (y.to(tl.float32) + delta).to(y.dtype), mask=y_mask & live)


def lora_add(
    y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int
) -> None:
    """y [T, out] += each token's B[slot] @ A[slot] @ x [T, in], in place; slots [T] (-1: none);
    a [slots * rank, in], b [out, slots * rank]."""
    tokens, in_features = x.shape
    out_features, width = b.shape
    rp = triton.next_power_of_2(rank)
    v = torch.empty(tokens, rp, dtype=torch.float32, device=x.device)  # [T, RP]
    lora_shrink_kernel[(tokens,)](x, slots, a, v, in_features, R=rank, RP=rp, BLOCK=BLOCK_K)
    grid = (tokens, triton.cdiv(out_features, BLOCK_N))
    lora_expand_kernel[grid](v, slots, b, y, out_features, width, R=rank, RP=rp, BLOCK=BLOCK_N)


@torch.library.custom_op("batchgen::lora_add", mutates_args=())
def lora_add_op(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                rank: int) -> torch.Tensor:  # fmt: skip
    """y + the tokens' LoRA updates (a new tensor): the op torch.compile sees."""
    out = y.contiguous().clone()
    lora_add(out, x.contiguous(), slots.contiguous(), a, b, rank)
    return out


@lora_add_op.register_fake
def _(
    y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rank: int
) -> torch.Tensor:
    return torch.empty_like(y)
