"""LoRALinear: a linear layer plus the low-rank updates of every resident adapter, in one pass.

Why one pass for all adapters: rows of different adapters (and of the base model) share a step.
Each wrapped layer holds every slot's A stacked as [slots * R, in] and B (scaling folded in) as
[out, slots * R], R = max_lora_rank (smaller ranks zero-padded). A step's tokens each name a
slot (-1: the base); the step's column mask [T, slots * R] keeps, for each token, only its slot's
R columns. So the update is two dense products whose shapes never change with the adapters in
the batch: x @ A^T (every slot's shrink at once), masked, then @ B^T (each token's own expand).
Static shapes and static buffers keep torch.compile and CUDA graphs valid; a base row's update is
exactly zero. The extra work is 2 * slots * R multiply-adds per input/output feature of a token,
small beside the layer's own in * out (the Triton kernel, lora/triton_kernel, skips other slots).
"""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    """`base` (the model's own linear, unchanged) + the step's per-token adapter updates."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_mask: torch.Tensor

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        # why buffers: torch.compile and CUDA graphs read them in place; slots load into them
        self.register_buffer("lora_a", lora_a, persistent=False)  # [slots * R, in]
        self.register_buffer("lora_b", lora_b, persistent=False)  # [out, slots * R], scaling folded in
        self.register_buffer("lora_mask", mask, persistent=False)  # [max tokens, slots * R], shared by all layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, in] -> [..., T, out]."""
        out = self.base(x)
        shrunk = nn.functional.linear(x, self.lora_a) * self.lora_mask[: x.shape[-2]]  # [..., T, slots * R]
        return out + nn.functional.linear(shrunk, self.lora_b)  # [..., T, out]
