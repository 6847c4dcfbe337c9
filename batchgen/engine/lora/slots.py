"""LoRASlots: the device side of adapters: `max_loras` static slots in every linear layer, and the
step's per-token slot mask.

Why static slots: the model's buffers never change shape or address, so a compiled forward and
captured CUDA graphs stay valid while adapters come and go; loading an adapter is copying its A
and B into one slot's rows and columns (zeros where it has no weights or a smaller rank). Which
adapter sits in which slot is the scheduler's decision (core/adapter_slots); its loads and each
chunk's slot reach the runner as data in the scheduled step, and the per-token slot ids ride in
the step's one upload (staging/transfers), behind which the mask is computed on the device.
Installed before the KV pool is sized, so the slots' memory is counted out of the pool's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from batchgen.engine.attention.planning import int64_tensor
from batchgen.engine.lora.layer import LoRALinear
from batchgen.engine.lora.store import AdapterStore
from batchgen.engine.lora.targets import linear_modules, linear_shape
from batchgen.engine.staging.transfers import Transfers

logger = logging.getLogger(__name__)

NO_SLOT = -1  # a base-model token


class LoRASlots:
    """The slots of one model; `install` wraps its linear layers."""

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_rank: int,
        max_tokens: int,
        store: AdapterStore,
        device: torch.device,
        dtype: torch.dtype,
        kernel: bool = False,
    ) -> None:
        """`kernel`: the layers use the Triton kernels (lora/triton_kernel), else the masked product."""
        self.max_loras, self.max_rank, self.store, self.kernel = max_loras, max_rank, store, kernel
        if kernel:
            import batchgen.engine.lora.triton_kernel  # noqa: F401  # registers batchgen::lora_add
        width = max_loras * max_rank
        self.mask = torch.zeros(max_tokens, width, dtype=dtype, device=device)  # [max tokens, slots * R]
        self.column_slot = torch.arange(width, device=device) // max_rank  # [slots * R]: each column's slot
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)  # [max tokens]
        self.layers: dict[str, LoRALinear] = {}  # by the adapter's module names (a VLM's: lora_prefix)
        prefix = str(getattr(model, "lora_prefix", ""))
        for name, module in linear_modules(model).items():
            shape = linear_shape(module)
            assert shape is not None  # linear_modules keeps linears only
            a = torch.zeros(width, shape[0], dtype=dtype, device=device)  # [slots * R, in]
            b = torch.zeros(shape[1], width, dtype=dtype, device=device)  # [out, slots * R]
            layer = LoRALinear(module, a, b, self.mask, self.token_slots, max_rank if kernel else 0)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            self.layers[prefix + name] = layer
        self.resident: list[bytes | None] = [None] * max_loras  # content hash per slot (the loads seen)
        nbytes = sum(layer.lora_a.numel() + layer.lora_b.numel() for layer in self.layers.values())
        logger.info(
            "LoRA: %d slots of rank %d in %d linear layers (%.1f MiB)",
            max_loras,
            max_rank,
            len(self.layers),
            nbytes * self.mask.element_size() / 2**20,
        )

    def load(self, loads: Sequence[tuple[int, bytes]]) -> None:
        """Copy each (slot, adapter) into its slot, in every layer (zeros where the adapter has no
        weights); a direct copy of weights, not step metadata, so outside the step's upload."""
        r = self.max_rank
        for slot, content_hash in loads:
            weights = self.store.weights(content_hash)
            for name, layer in self.layers.items():
                a, b = layer.lora_a[slot * r : (slot + 1) * r], layer.lora_b[:, slot * r : (slot + 1) * r]
                a.zero_()
                b.zero_()
                held = weights.get(name)
                if held is not None:
                    rank = held[0].shape[0]
                    a[:rank].copy_(held[0])  # [rank, in]
                    b[:, :rank].copy_(held[1])  # [out, rank]
            self.resident[slot] = content_hash
            logger.debug("LoRA: adapter %r in slot %d", self.store.specs[content_hash].name, slot)

    def stage(self, transfers: Transfers, token_slots: list[int]) -> None:
        """The step's slot per token (packed order, padding included) into the upload; the mask
        rows follow on the device right behind it."""
        n = len(token_slots)
        if n > self.mask.shape[0]:
            raise RuntimeError(f"LoRA: a step of {n} tokens is above the {self.mask.shape[0]} the slots were sized for")
        staged = transfers.stage(int64_tensor(token_slots))  # [n]
        if self.kernel:
            transfers.on_upload(lambda: self.token_slots[:n].copy_(staged))
        else:
            mask = self.mask[:n]
            transfers.on_upload(lambda: mask.copy_(staged[:, None] == self.column_slot))
