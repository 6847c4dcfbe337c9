"""TritonBackend ("triton"): every layer stores its K/V and attends the whole step with two Triton kernels.

Why a backend of its own: the torch backend copies decode blocks every layer (or on CUDA needs
256-token blocks, coarsening prefix caching and unable to soft-cap); this one reads 16-token blocks
in place, windows, soft-capping, any GQA ratio and images whose tokens attend both ways (Gemma 3)
included, and keeps no decode state. A graph decode step is planned from fixed buffers
(plan.GraphRows). On the CPU: Triton's interpreter only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchgen.engine.attention.backend import AttentionBackend, Pools, zero_padding
from batchgen.engine.attention.gather import GatheredBlocks
from batchgen.engine.attention.metadata import MAX_GRAPH_BATCH, ForwardContext
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.attention.planning import PlannedChunk, build_forward_context
from batchgen.engine.staging.transfers import Transfers
from batchgen.engine.triton import launch
from batchgen.engine.triton.plan import GraphRows, KernelPlan, TritonContext, image_key_ends, tile_map, tile_rows
from batchgen.engine.triton.support import check_device, interpreting


class TritonBackend(AttentionBackend):
    name = "triton"
    replays_static_decode = True

    def __init__(self, kv_caches: Pools, block_size: int, device: torch.device, num_heads: int) -> None:
        check_device(device)  # on the CPU: its interpreter too
        # why a decode source at all: the interface has one; this backend never asks it to plan (every
        # chunk reads the pool), and gathered blocks keep nothing across steps
        super().__init__(kv_caches, block_size, device, GatheredBlocks(block_size))
        kv_heads = kv_caches[0][0].shape[2]
        if num_heads % kv_heads:
            raise ValueError(f"{num_heads} attention heads do not share {kv_heads} KV heads evenly")
        self.group = num_heads // kv_heads
        self.graph_rows = GraphRows(MAX_GRAPH_BATCH, self.group, device)

    def describe(self) -> str:
        return "triton (paged kernel, interpreted)" if interpreting() else "triton (paged kernel)"

    def plan(
        self, chunks: Sequence[PlannedChunk], stager: Transfers, padded_len: int | None = None
    ) -> tuple[ForwardContext, torch.Tensor, list[int]]:
        """The step's plan -> (context, positions [T], packed order: batch order); staged in `stager`.
        Why the varlen planning: it is exactly "every chunk reads the pool" (the source plans no decode)."""
        ctx, positions, order = build_forward_context(
            chunks, self.decode_kv, self.kv_caches, self.block_size, stager, flash=True, padded_len=padded_len
        )
        meta = ctx.flash
        assert meta is not None  # build_forward_context sets it when asked
        q_lens = [chunks[i].num_tokens for i in order]
        rows = tile_rows(self.group, decode_only=max(q_lens) == 1)
        tile_chunk, tile_first = tile_map(q_lens, rows // self.group)
        plan = KernelPlan(
            query_start=meta.cu_seqlens_q,
            kv_lens=meta.seqused_k,
            block_tables=meta.block_tables,
            tile_chunk=stager.stage(tile_chunk),
            tile_first=stager.stage(tile_first),
            group=self.group,
            rows=rows,
        )
        ctx = TritonContext(ctx.kv_caches, ctx.slot_mapping, None, ctx.prefills, num_tokens=ctx.num_tokens, kernel=plan)
        return ctx, positions, order

    def run_layer(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [H, T, D], key/value [KVH, T, D]: store the K/V, attend -> [T, H, D] (padded rows zero)."""
        ctx, k_cache, v_cache = self.begin_layer(call.layer, key)
        plan = self._kernel_plan(ctx)
        launch.store_kv(k_cache, v_cache, ctx.slot_mapping, key, value)
        out = launch.paged_attention(query, k_cache, v_cache, plan, call, _key_ends(ctx, query))
        return zero_padding(out, ctx)  # why: rows past the step's tokens belong to no tile

    def _kernel_plan(self, ctx: ForwardContext) -> KernelPlan:
        if isinstance(ctx, TritonContext) and ctx.kernel is not None:
            return ctx.kernel
        if ctx.static_decode is not None:  # a CUDA-graph decode step (cuda/graphs), planned by the runner
            return self.graph_rows.plan(ctx.static_decode)
        raise RuntimeError("the triton backend runs only steps it planned itself or CUDA-graph decode steps")


def _key_ends(ctx: ForwardContext, query: torch.Tensor) -> torch.Tensor | None:
    """The step's image key bounds [T] (plan.image_key_ends), made by its first layer; None: none."""
    if not isinstance(ctx, TritonContext):
        return None
    if not ctx.key_ends_made:  # why lazily: the images are marked after planning (engine/vision)
        ctx.key_ends = image_key_ends(ctx.prefills, query.shape[1], query.device)
        ctx.key_ends_made = True
    return ctx.key_ends
