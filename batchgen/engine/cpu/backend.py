"""CpuBackend ("cpu"): decode attention over contiguous decode rows by the native kernel, with its C++ front.

Why a backend of its own: on a CPU a decode step is memory-bound, and three things measured
faster there than the torch backend's gathered blocks (benchmarks/RESULTS.md): a contiguous row
of K/V per decoding sequence (decode_rows), the native decode kernel that appends and attends
every decode in one call per layer (decode_native), and the C++ operator that calls that kernel
without Python per layer on decode-only steps (front). Everything else (prefills, mixed steps) is
the torch backend's code, which this one is tested against.

Where the kernel cannot attend the model (Gemma 2's soft-capping, no compiler, BATCHGEN_NATIVE=0,
fp16, or bf16 where its bf16 twin measured slower than torch on this machine: native_wins),
`attention_backend: cpu` makes the torch backend (make_cpu_backend): the rows exist only for the
kernel (a torch-math path over rows was ~20% faster than gathered blocks on mixed-length decodes
without the kernel, and was cut for the ~200 lines it cost).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import PretrainedConfig

from batchgen.engine.attention.backend import AttentionBackend, Pools, TorchBackend
from batchgen.engine.attention.decode_kv import gather_blocks
from batchgen.engine.attention.metadata import ForwardContext
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.attention.path import has_softcap
from batchgen.engine.cpu import native
from batchgen.engine.cpu.choice_cache import choice_path, interleaved_best, read_choice, write_once
from batchgen.engine.cpu.decode_native import ClassRows, NativeStep, Scratch
from batchgen.engine.cpu.decode_rows import DecodeRows, RowsView
from batchgen.engine.cpu.front import Front, open_front

logger = logging.getLogger(__name__)

ROWS, LENGTH, CAPACITY = 16, 256, 512  # native_wins' decode step: sequences, positions, row length
REPEATS = 7


def make_cpu_backend(
    kv_caches: Pools,
    block_size: int,
    device: torch.device,
    config: PretrainedConfig,
    dtype: torch.dtype,
    max_len: int,
    max_rows: int | None,
) -> AttentionBackend:
    """The cpu backend where the native kernel attends this model's decodes, else the torch backend."""
    if missing := native.pending():
        logger.warning(
            "building the native CPU kernels for this machine before the first step (%s; %s, once per machine;"
            " `batchgen doctor --build` builds them ahead of a job)",
            ", ".join(missing),
            native.BUILD_SECONDS,
        )
    _, _, kvh, head_dim = kv_caches[0][0].shape
    if not kernel_attends(config, kvh, head_dim, dtype):
        logger.info("attention_backend cpu: the native kernel does not attend this model here; the torch backend does")
        return TorchBackend(kv_caches, block_size, device)
    return CpuBackend(kv_caches, block_size, device, config, max_len, max_rows)


class CpuBackend(AttentionBackend):
    name = "cpu"

    def __init__(
        self,
        kv_caches: Pools,
        block_size: int,
        device: torch.device,
        config: PretrainedConfig,
        max_len: int,
        max_rows: int | None,
    ) -> None:
        k_pool = kv_caches[0][0]  # [blocks, block_size, KVH, D]
        _, _, kvh, head_dim = k_pool.shape
        pool_tokens = (k_pool.shape[0] - 1) * block_size  # the pool's tokens, without its trash block
        rows = DecodeRows(
            len(kv_caches), kvh, head_dim, block_size, max_len, k_pool.dtype, device, max_rows, pool_tokens
        )
        super().__init__(kv_caches, block_size, device, rows)
        self.num_heads = config.get_text_config().num_attention_heads
        # the C++ front attends decode-only steps of the native kernel without Python per layer
        self.front: Front | None = open_front(self.handle)

    def describe(self) -> str:
        return f"cpu (decode rows, native kernel{' through the C++ front' if self.front else ''})"

    @contextmanager
    def running(self, ctx: ForwardContext) -> Iterator[None]:
        """As the torch backend; when the step is decodes only on the native kernel, the front attends
        every layer itself (new rows filled from the pool first, for every layer)."""
        with super().running(ctx):
            step = ctx.decodes
            plain = not ctx.prefills and ctx.flash is None
            if self.front is None or not plain or not isinstance(step, RowsView):
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


def kernel_attends(config: PretrainedConfig, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the kernel attends this model's decodes here: float32 rows, or bf16 rows where its
    bf16 twin measured faster than torch's gathered blocks on this machine (native_wins); no
    logit soft-capping (Gemma 2 keeps the torch math), query heads per KV head and head dim within
    the kernel's limits, and the kernel built (native.load logs why not)."""
    if dtype not in native.KERNEL_DTYPES or has_softcap(config):
        return False
    heads = config.get_text_config().num_attention_heads
    if heads % kv_heads or heads // kv_heads > native.MAX_G or head_dim > native.MAX_D:
        return False
    return native.load() is not None and native_wins(dtype, kv_heads, heads // kv_heads, head_dim)


def native_wins(dtype: torch.dtype, kv_heads: int, group: int, head_dim: int) -> bool:
    """Whether the native kernel attends this shape's decodes faster than the torch backend would
    (float32: always taken, untimed; other dtypes than bf16: never, the kernel cannot read them).

    Why measured for bf16: SDPA's bf16 decodes were 10-20x slower on an AMD Zen 4 than on an Intel
    Xeon with AMX, and no ISA rule predicts the kernel's bf16 twin against them, so the two are timed
    side by side, interleaved, once per machine, torch version, thread count and shape. The result
    is cached and never replaced, so every process on a machine takes the same path (their tokens agree).
    """
    if dtype == torch.float32 or dtype not in native.KERNEL_DTYPES:
        return dtype == torch.float32
    key = f"{(native.load() or Path()).name}\0{dtype}\0{kv_heads}\0{group}\0{head_dim}"
    path = choice_path("decode-native-vs-gather", key)
    stored = read_choice(path, "native")
    if stored is not None:
        return bool(stored)
    times = _time_paths(dtype, kv_heads, group, head_dim)
    if times["native"] >= times["gather"]:  # a second round first: a busy spell can stall
        again = _time_paths(dtype, kv_heads, group, head_dim)  # oneDNN's threads for a whole round
        times = {name: min(s, again[name]) for name, s in times.items()}
    wins = times["native"] < times["gather"]
    logger.info(
        "decode attention in %s (KVH %d, G %d, D %d): native %.2f ms, gathered blocks %.2f ms: %s",
        dtype, kv_heads, group, head_dim, times["native"] * 1e3, times["gather"] * 1e3, "native" if wins else "torch",
    )  # fmt: skip
    return bool(write_once(path, "native", {"native": wins, **{f"{name}_s": s for name, s in times.items()}}))


def _time_paths(dtype: torch.dtype, kvh: int, g: int, d: int) -> dict[str, float]:
    """Best seconds of each path over REPEATS interleaved runs (one warm-up each), ROWS decodes of
    LENGTH positions: {"native": the kernel, "gather": the torch backend's gather and SDPA}."""
    gen = torch.Generator().manual_seed(0)
    blocks = LENGTH // 16  # each decode's blocks of 16 positions in a pool of ROWS * blocks
    pool_k, pool_v = torch.randn(2, ROWS * blocks, 16, kvh, d, generator=gen).to(dtype)  # [blocks, 16, KVH, D]
    index = torch.randperm(ROWS * blocks, generator=gen)  # [ROWS * blocks] scattered, as a pool holds them
    q = torch.randn(ROWS, kvh, g, d, generator=gen).to(dtype)  # [B, KVH, G, D]
    mask = torch.ones(ROWS, 1, g, LENGTH, dtype=torch.bool)

    def gather() -> None:
        k, v = gather_blocks(pool_k, index, ROWS), gather_blocks(pool_v, index, ROWS)  # [B, KVH, L, D]
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5)

    # the kernel: one layer of the same decodes in rows of CAPACITY (each call appends its step's
    # K/V at the last position, as a decode does)
    tiles = CAPACITY // native.TILE
    k = torch.randn(ROWS, kvh, tiles, d, native.TILE, generator=gen).to(dtype)  # [B, KVH, cap / TILE, D, TILE]
    v = torch.randn(ROWS, kvh, CAPACITY, d, generator=gen).to(dtype)  # [B, KVH, cap, D]
    step = NativeStep([ClassRows([k], [v], ROWS, 0)], [LENGTH] * ROWS, Scratch())
    q_t = torch.randn(kvh * g, ROWS, d, generator=gen).to(dtype)  # [H, T, D]
    new_k = torch.randn(kvh, ROWS, d, generator=gen).to(dtype)  # [KVH, T, D]
    new_v = torch.randn(kvh, ROWS, d, generator=gen).to(dtype)
    out = torch.empty(ROWS, kvh * g, d, dtype=dtype)  # [T, H, D]
    paths = {"native": lambda: step.attend(0, q_t, new_k, new_v, out, d**-0.5, None), "gather": gather}
    best = interleaved_best(paths, REPEATS)
    assert best is not None  # no deadline
    return best
