"""CpuBackend ("cpu"): attention over contiguous decode rows, with the native kernel and its C++ front.

Why a backend of its own: on a CPU a decode step is memory-bound, and three things measured
faster there than the torch backend's gathered blocks (benchmarks/RESULTS.md): a contiguous row
of K/V per decoding sequence (decode_rows), the native decode kernel that appends and attends
every decode in one call per layer (decode_native, where it can attend the model: float32 rows,
or bf16 rows where its bf16 twin measured faster than torch on this machine; no soft-capping),
and the C++ operator that calls that kernel without Python per layer on decode-only steps
(front). Without the kernel (Gemma 2's soft-capping, no compiler, bf16 where torch measured
faster) the rows are attended with the torch backend's math, in the key layout measured faster
for the model's shape (decode_layout: batched products in float32 softmax, or SDPA). Everything
else (prefills, mixed steps) is the torch backend's code, which this one is tested against.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PretrainedConfig

from batchgen.engine.attention.backend import AttentionBackend, Pools
from batchgen.engine.attention.metadata import ForwardContext
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.attention.path import has_softcap
from batchgen.engine.cpu import native
from batchgen.engine.cpu.decode_layout import keys_transposed, native_wins
from batchgen.engine.cpu.decode_rows import DecodeRows
from batchgen.engine.cpu.front import Front, open_front
from batchgen.engine.cpu.native import NativeKernels
from batchgen.engine.cpu.rows_view import RowsView

logger = logging.getLogger(__name__)


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(
        self,
        kv_caches: Pools,
        block_size: int,
        device: torch.device,
        config: PretrainedConfig,
        dtype: torch.dtype,
        max_len: int,
        max_rows: int | None,
    ) -> None:
        if missing := native.pending():
            logger.warning(
                "building the native CPU kernels for this machine before the first step (%s; %s, once per machine;"
                " `batchgen doctor --build` builds them ahead of a job)",
                ", ".join(missing),
                native.BUILD_SECONDS,
            )
        _, _, kvh, head_dim = kv_caches[0][0].shape
        kernels = kernels_for(config, kvh, head_dim, dtype)
        heads = config.get_text_config().num_attention_heads
        transposed = None if kernels is not None else keys_transposed(dtype, kvh, heads // kvh, head_dim)
        rows = DecodeRows(
            len(kv_caches),
            kvh,
            head_dim,
            block_size,
            max_len,
            dtype,
            device,
            max_rows,
            (kv_caches[0][0].shape[0] - 1) * block_size,  # the pool's tokens, without its trash block
            kernels,
            transposed,
        )
        super().__init__(kv_caches, block_size, device, rows)
        self.rows = rows
        self.num_heads = config.get_text_config().num_attention_heads
        # the C++ front attends decode-only steps of the native kernel without Python per layer
        self.front: Front | None = open_front(self.handle) if rows.native is not None else None

    def describe(self) -> str:
        kernel = "native kernel through the C++ front" if self.front else "native kernel" if self.rows.native else ""
        return f"cpu (decode rows{', ' + kernel if kernel else ''})"

    @contextmanager
    def running(self, ctx: ForwardContext) -> Iterator[None]:
        """As the torch backend; when the step is decodes only on the native kernel, the front attends
        every layer itself (new rows filled from the pool first, for every layer)."""
        with super().running(ctx):
            step = ctx.decodes
            plain = not ctx.prefills and ctx.flash is None and ctx.static_decode is None
            if self.front is None or not plain or not isinstance(step, RowsView) or step.native is None:
                yield
                return
            step.fill_all(ctx.kv_caches)
            plan = step.native.front_plan(ctx.kv_caches, ctx.slot_mapping, self.num_heads, ctx.num_tokens)
            with self.front.planned(plan):
                yield
            ctx.num_attention_calls += plan.calls
            step.native.calls += plan.calls

    def call_layer(self, call: LayerCall, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Through the C++ operator where it loaded (it attends a planned step, else calls the Python op)."""
        if self.front is None:
            return super().call_layer(call, query, key, value)
        layer, scale, window, softcap = call
        op = torch.ops.batchgen.attention
        return op(query, key, value, scale, window, softcap, self.handle, layer)

    def take_raised(self) -> BaseException | None:
        raised = super().take_raised()
        message = self.front.take_error() if self.front is not None else None
        return RuntimeError(message) if raised is None and message else raised


def kernels_for(config: PretrainedConfig, kv_heads: int, head_dim: int, dtype: torch.dtype) -> NativeKernels | None:
    """The kernel, where it can attend this model's decodes: float32 rows, or bf16 rows where its
    bf16 twin measured faster than torch's paths on this machine (decode_layout.native_wins); no
    logit soft-capping (Gemma 2 keeps the torch math), query heads per KV head and head dim within
    the kernel's limits. None elsewhere, or where it cannot be built (native.load logs why)."""
    if dtype not in native.KERNEL_DTYPES or has_softcap(config):
        return None
    heads = config.get_text_config().num_attention_heads
    if heads % kv_heads or heads // kv_heads > native.MAX_G or head_dim > native.MAX_D:
        return None
    kernels = native.load()
    if kernels is None or not native_wins(dtype, kv_heads, heads // kv_heads, head_dim, kernels):
        return None
    return kernels
