"""The attention-backend interface, and the portable torch backend that is its reference.

A backend is one object per engine owning all the attention keeps (KV pool, decode K/V source,
the step's plan, its op's last exception; no module globals, so two engines coexist). Per step:
`plan(chunks)` once, `with running(ctx):` around the forward, each layer's `call_layer`, then
`release(seq_ids)` / `reset()`. `TorchBackend` (torch ops over gathered blocks; CUDA's varlen
kernel where chosen) is the reference the cpu and triton backends are tested against.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import ClassVar

import torch

from batchgen.engine.attention import op as attention_op
from batchgen.engine.attention.decode_kv import DecodeKVSource
from batchgen.engine.attention.gather import GatheredBlocks
from batchgen.engine.attention.kv_store import store_kv
from batchgen.engine.attention.metadata import ForwardContext
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.attention.path import varlen_paged_attention
from batchgen.engine.attention.planning import PlannedChunk, build_forward_context
from batchgen.engine.attention.torch_math import torch_paged_attention
from batchgen.engine.staging.transfers import Transfers

Pools = list[tuple[torch.Tensor, torch.Tensor]]  # per layer K, V: [num_blocks, block_size, KVH, D]


class AttentionBackend:
    """The interface, with the torch implementation of every part; subclasses change the decode
    source and may attend some steps their own way (see the module docstring)."""

    name: ClassVar[str] = "torch"
    # why a flag: a CUDA-graph decode step attends over the static buffers' full-width block tables
    # (cuda/graphs), which only a backend that reads the pool in place does at the cost of the real
    # lengths (triton); the others would gather the full width every step
    replays_static_decode: ClassVar[bool] = False

    def __init__(self, kv_caches: Pools, block_size: int, device: torch.device, decode_kv: DecodeKVSource) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.decode_kv = decode_kv
        self.flash = False  # set by the runner where it chose the paged varlen kernel (CUDA)
        self.context: ForwardContext | None = None  # the step being run (set by running())
        self.raised: BaseException | None = None  # the op's last exception (see attention/op)
        self.handle = attention_op.register(self)

    def describe(self) -> str:
        """How this backend attends, for the engine's log line."""
        return self.name

    def plan(
        self, chunks: Sequence[PlannedChunk], stager: Transfers, padded_len: int | None = None
    ) -> tuple[ForwardContext, torch.Tensor, list[int]]:
        """The step's plan -> (context, positions [T], packed order of the chunks); tensors staged in `stager`."""
        return build_forward_context(
            chunks, self.decode_kv, self.kv_caches, self.block_size, stager, self.flash, padded_len
        )

    @contextmanager
    def running(self, ctx: ForwardContext) -> Iterator[None]:
        """`ctx` is this backend's step for the forward inside (or a CUDA graph's warm-up and capture)."""
        ctx.num_attention_calls = 0
        self.context = ctx
        try:
            yield
        finally:
            self.context = None

    def call_layer(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [H, T, D], key/value [KVH, T, D] -> [T, H, D]; the custom op only while compiling
        (eager runs call its body directly, without the op's dispatch)."""
        if torch.compiler.is_compiling():
            layer, scale, window, softcap = call
            return attention_op.paged_attention(query, key, value, scale, window, softcap, self.handle, layer)
        return self.run_layer(call, query, key, value)

    def run_layer(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """One layer of the current step: store its K/V in the pool, attend -> [T, H, D] (padded rows zero)."""
        layer, scale, window, softcap = call
        ctx, k_cache, v_cache = self.begin_layer(layer, key)
        # a decode-only step whose decode source stores the K/V itself (the native kernel, with its attention)
        plain = ctx.flash is None and not ctx.prefills and softcap is None
        decodes_store = plain and ctx.decodes is not None and ctx.decodes.writes_pool
        if not decodes_store:
            padded = ctx.num_tokens != ctx.slot_mapping.shape[0]
            # key/value [KVH, T, D] -> pool slots of this step (padded tokens, slot -1, go to the trash block)
            store_kv(k_cache, v_cache, ctx.slot_mapping, key.transpose(0, 1), value.transpose(0, 1), padded)
        if ctx.flash is not None:
            if softcap is not None:  # why: the runner chose this path from the config; never run it wrong
                raise RuntimeError(f"layer {layer} soft-caps its logits; the varlen kernel cannot")
            out = varlen_paged_attention(ctx.flash, k_cache, v_cache, query, scale, window)
        else:
            slots = ctx.slot_mapping if decodes_store else None
            out = torch_paged_attention(ctx, call, query, key, value, slots)
        return zero_padding(out, ctx)

    def begin_layer(self, layer: int, key: torch.Tensor) -> tuple[ForwardContext, torch.Tensor, torch.Tensor]:
        """The checks every backend's run_layer starts with -> (the current step, the layer's K and V pool).

        Counts the call (the runner checks that every layer came through the backend)."""
        ctx = self.context
        if ctx is None:
            raise RuntimeError("batchgen's attention ran outside a step (no plan is set: see AttentionBackend.running)")
        if not 0 <= layer < len(self.kv_caches):
            raise RuntimeError(f"attention for layer {layer}, but the KV pool has {len(self.kv_caches)} layers")
        ctx.num_attention_calls += 1
        k_cache, v_cache = self.kv_caches[layer]
        if k_cache.shape[2:] != key.shape[0:1] + key.shape[2:]:
            raise RuntimeError(
                f"layer {layer}: model produced K/V with {key.shape[0]} heads of dim {key.shape[2]} but the KV pool "
                f"was sized for {k_cache.shape[2]} heads of dim {k_cache.shape[3]}"
            )
        return ctx, k_cache, v_cache

    def take_raised(self) -> BaseException | None:
        """The exception the op raised since the last call (None: none), forgotten once taken."""
        raised, self.raised = self.raised, None
        return raised

    def release(self, seq_ids: Iterable[int]) -> None:
        """These sequences are finished or preempted: their decode state can go."""
        self.decode_kv.release(seq_ids)

    def reset(self) -> None:
        """Forget every sequence (after an aborted step)."""
        self.decode_kv.reset()


class TorchBackend(AttentionBackend):
    """The portable backend: torch ops over gathered blocks (and CUDA's varlen kernel and graphs)."""

    name = "torch"

    def __init__(self, kv_caches: Pools, block_size: int, device: torch.device) -> None:
        super().__init__(kv_caches, block_size, device, GatheredBlocks(block_size))


def zero_padding(out: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """`out` [T, H, D] with its rows past the step's real tokens zeroed: padding rows are never read,
    but the layers after compute on them, so they must stay finite."""
    if ctx.num_tokens < out.shape[0]:
        out[ctx.num_tokens :] = 0
    return out
