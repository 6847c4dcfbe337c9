"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket, all captured at start.

Why: a small decode step is bound by kernel launches; a graph replays them in one, on fixed shapes
and addresses. A decode-only step is padded to the next bucket (2, 4, 8, then multiples of 16; no
1, which dynamo would specialise), its inputs copied into static buffers, its graph replayed;
padded rows write the trash block. Every graph is captured at start (`capture_all`: no pause
mid-job, and runner/pool_sizing measures their pool). The attention reads `StaticDecode`; only the
triton backend replays graphs. No CPU test covers `capture` / `replay` themselves (the tests stand in for them).

A vision-language model's decode steps replay graphs too (no image is spliced into a decode: its
embeddings are the plain lookup, captured with the rest). Under M-RoPE (Qwen2-VL) the model's
positions are not the KV positions: a generated token's three axes are its index plus its
request's delta, staged per step into `rope_positions` [3, B] beside the KV `positions` [B].
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgen.engine.attention.kv_store import PAD_SLOT
from batchgen.engine.attention.metadata import MAX_GRAPH_BATCH, StaticDecode

logger = logging.getLogger(__name__)

Runner = Callable[[object, Callable[[], torch.Tensor]], torch.Tensor]  # (step context, forward call) -> logits
ContextMaker = Callable[[torch.Tensor, StaticDecode, int], object]  # (slots, static tables, bucket) -> context

MIN_GRAPH_BATCH = 2  # see the module docstring: a bucket of 1 would be a second compiled graph


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 2, 4, 8, 16, 32, 48, ... up to max_num_seqs (included, at least 2)."""
    top = max(MIN_GRAPH_BATCH, min(max_num_seqs, MAX_GRAPH_BATCH))
    sizes = [b for b in (2, 4, 8) if b < top] + list(range(16, top, 16))
    return sorted({*sizes, top})


def pick_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n decodes; None when none does (the step runs without a graph)."""
    return next((b for b in buckets if b >= n), None)


class DecodeBuffers:
    """Static inputs for the largest bucket; a bucket's graph uses their first B rows.
    `rope_axes` (3 under M-RoPE): the model's positions are then `rope_positions`, not `positions`."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, rope_axes: int = 0) -> None:
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)  # KV positions
        # [axes, max_batch] the model's rotary positions (M-RoPE), or None: the model reads `positions`
        self.rope_positions = torch.zeros(rope_axes, max_batch, dtype=torch.int64, device=device) if rope_axes else None
        self.slots = torch.full((max_batch,), PAD_SLOT, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        # why a buffer: a graph reads the logit rows to keep at every replay, so they must live as
        # long as the graphs (a tensor made for one capture would be freed and its memory reused)
        self.keep = torch.arange(max_batch, device=device)

    def fill(
        self,
        n: int,
        bucket: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        rope_positions: torch.Tensor | None = None,
    ) -> None:
        """Rows 0..n-1 from this step (device tensors: ids [n], positions [n], tables [n, w], M-RoPE's
        rope_positions [axes, n]); n..bucket-1 padding."""
        if (rope_positions is None) != (self.rope_positions is None):
            raise RuntimeError("a decode step's M-RoPE positions do not match the graphs' buffers")
        if self.rope_positions is not None and rope_positions is not None:
            self.rope_positions[:, :n].copy_(rope_positions)
            self.rope_positions[:, n:bucket].zero_()
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.context_lens[:n].copy_(positions + 1)
        self.block_tables[:bucket].zero_()
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.context_lens[n:bucket].fill_(1)
        self.slots[n:bucket].fill_(PAD_SLOT)

    def set_slots(self, n: int, block_size: int) -> None:
        """Slots of rows 0..n-1 from their tables and positions (device-side, no host values)."""
        rows = torch.arange(n, device=self.positions.device)
        pos = self.positions[:n]
        self.slots[:n] = self.block_tables[rows, pos // block_size] * block_size + pos % block_size

    def model_positions(self, bucket: int) -> torch.Tensor:
        """What a bucket's forward takes as positions: [bucket], or M-RoPE's [axes, bucket]."""
        if self.rope_positions is not None:
            return self.rope_positions[:, :bucket]
        return self.positions[:bucket]

    def view(self, bucket: int) -> StaticDecode:
        """The first `bucket` rows, every block of each."""
        return StaticDecode(self.block_tables[:bucket], self.context_lens[:bucket])


class GraphDecode:  # pragma: no cover - needs CUDA (its CPU-testable pieces are above)
    """The model runner's decode-only steps on CUDA: fill the static buffers, replay the bucket's graph,
    one CUDA graph per bucket over `forward(input_ids, positions, keep) -> logits [B, V]`."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
        rope_axes: int = 0,
    ) -> None:
        self.forward, self.block_size = forward, block_size
        self.buckets = decode_buckets(max_num_seqs)
        self.buffers = DecodeBuffers(self.buckets[-1], max_blocks, device, rope_axes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: torch.Tensor | None = None  # [max batch, V] logits every graph writes its rows into
        self.pool: Any = None  # the graphs share one memory pool
        self.disabled = False  # a capture failed (e.g. a model with data-dependent Python): eager from then on
        # why counted: each capture syncs the device and runs the forward twice, so a capture inside a
        # timed window (or mid-job) is a pause; the GPU check asserts none happen while it times
        self.captures = 0  # capture attempts, failed ones included
        self.captures_after_start = 0  # of those, the ones a step made (capture_all leaves none to make)
        self.replays = 0  # decode steps served by a graph (the GPU checks report it)

    def step_call(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The forward of `bucket` rows, reading nothing but the static buffers."""
        buf = self.buffers
        return lambda: self.forward(buf.input_ids[:bucket], buf.model_positions(bucket), buf.keep[:bucket])

    def capture(self, bucket: int, run: Callable[[Callable[[], torch.Tensor]], torch.Tensor]) -> None:
        """Capture the forward for `bucket` rows; `run` sets the step's context around the call (logits
        copied into one shared `out`, so no graph keeps its own [B, V] alive)."""
        call = self.step_call(bucket)
        warm = run(call)  # warm-up outside the graph (allocator, lazy inits, compiling)
        if self.out is None:  # one model: the same vocabulary and dtype for every bucket
            self.out = warm.new_empty(self.buffers.keep.shape[0], *warm.shape[1:])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.out[:bucket].copy_(run(call))
        self.pool = graph.pool()
        self.graphs[bucket] = graph

    def replay(self, bucket: int, n: int) -> torch.Tensor:
        self.graphs[bucket].replay()
        return self.out[:n]  # type: ignore[index]  # set by the first capture

    def capture_all(self, run: Runner, make_context: ContextMaker) -> None:
        """Every bucket's graph, largest first (smaller ones then reuse its memory in the shared pool),
        over the buffers as made: every row padding."""
        for bucket in reversed(self.buckets):
            if not self._capture(bucket, run, make_context):
                return

    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        run: Runner,
        make_context: ContextMaker,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Device ids/positions [n], tables [n, w], M-RoPE's rope_positions [axes, n] (uploaded) ->
        logits [n, V], or None: no bucket fits."""
        n = input_ids.shape[0]
        bucket = pick_bucket(n, self.buckets)
        if bucket is None or not self.fits(n, tables.shape[1]):
            return None
        self.buffers.fill(n, bucket, input_ids, positions, tables, rope_positions)
        self.buffers.set_slots(n, self.block_size)
        if bucket not in self.graphs:
            self.captures_after_start += 1
            if not self._capture(bucket, run, make_context):
                return None
        self.replays += 1
        return self.replay(bucket, n)

    def fits(self, n: int, blocks: int) -> bool:
        """Whether a decode step of n rows whose longest needs `blocks` blocks can replay a graph
        (known on the host, before anything is staged)."""
        return (
            not self.disabled
            and pick_bucket(n, self.buckets) is not None
            and blocks <= self.buffers.block_tables.shape[1]
        )

    def _capture(self, bucket: int, run: Runner, make_context: ContextMaker) -> bool:
        self.captures += 1
        ctx = make_context(self.buffers.slots[:bucket], self.buffers.view(bucket), bucket)
        try:
            self.capture(bucket, lambda call: run(ctx, call))
        except RuntimeError as exc:
            logger.warning("CUDA graph capture failed for %d rows; decode steps run without graphs: %s", bucket, exc)
            self.disabled = True
            return False
        return True
