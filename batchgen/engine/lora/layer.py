"""LoRALinear: a linear layer plus the low-rank updates of every resident adapter, in one pass.

Why one pass for all adapters: rows of different adapters (and of the base model) share a step.
Each wrapped layer holds every slot's A stacked as [slots * R, in] and B (scaling folded in) as
[out, slots * R], R = max_lora_rank (smaller ranks zero-padded). A step's tokens each name a
slot (-1: the base); the step's column mask [T, slots * R] keeps, for each token, only its slot's
R columns. So the update is two dense products whose shapes never change with the adapters in
the batch: x @ A^T (every slot's shrink at once), masked, then @ B^T (each token's own expand).
Static shapes and static buffers keep torch.compile and CUDA graphs valid; a base row's update is
exactly zero. The extra work is 2 * slots * R multiply-adds per input/output feature of a token,
small beside the layer's own in * out. On CUDA (and under the triton attention backend) the
Triton kernels (lora/triton_kernel) read each token's own slot only, from the step's slot ids.
"""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    """`base` (the model's own linear, unchanged) + the step's per-token adapter updates."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_mask: torch.Tensor
    lora_slots: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        mask: torch.Tensor,
        slots: torch.Tensor,
        kernel_rank: int = 0,
    ) -> None:
        """`kernel_rank` > 0: the Triton kernels with slots of that rank, from `slots`; 0: the masked product."""
        super().__init__()
        self.base = base
        self.kernel_rank = kernel_rank
        # why buffers: torch.compile and CUDA graphs read them in place; slots load into them
        self.register_buffer("lora_a", lora_a, persistent=False)  # [slots * R, in]
        self.register_buffer("lora_b", lora_b, persistent=False)  # [out, slots * R], scaling folded in
        self.register_buffer("lora_mask", mask, persistent=False)  # [max tokens, slots * R], shared by all layers
        self.register_buffer("lora_slots", slots, persistent=False)  # [max tokens] int64, shared by all layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, in] -> [..., T, out]."""
        out = self.base(x)
        if self.kernel_rank:
            flat = x.reshape(-1, x.shape[-1])  # [T, in]
            rows = self.lora_slots[: flat.shape[0]]
            y = out.reshape(-1, out.shape[-1])  # [T, out]
            return torch.ops.batchgen.lora_add(y, flat, rows, self.lora_a, self.lora_b, self.kernel_rank).view_as(out)
        shrunk = nn.functional.linear(x, self.lora_a) * self.lora_mask[: x.shape[-2]]  # [..., T, slots * R]
        return out + nn.functional.linear(shrunk, self.lora_b)  # [..., T, out]
