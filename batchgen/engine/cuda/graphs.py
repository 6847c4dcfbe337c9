"""CUDA graphs for decode-only steps: one captured forward per batch-size bucket, replayed on static buffers.

Why: a decode step of a small batch launches hundreds of small kernels; on a GPU their launch
cost, not the math, bounds the step. A CUDA graph replays them all in one launch, but only on
fixed shapes and fixed addresses. So a decode-only step of n sequences is padded to the next
bucket B (1, 2, 4, 8, then multiples of 16, as nano-vllm does), its inputs are copied into
static buffers sized for B, and the graph captured for B is replayed. Padded rows write the KV
pool's trash block (slot -1, see kv_store) and attend one zero key, so they stay finite.

During capture and replay the attention reads `StaticDecode` (block tables and context lengths
in the static buffers) instead of the step's decode groups: one fixed-shape gather + SDPA over
W blocks per row. Why W is bucketed too (powers of two from MIN_GRAPH_BLOCKS up to the longest
sequence the engine allows) and the graphs are keyed by (B, W): one width for every step would
gather max_model_len tokens per row each step (for a 32k-token model at 256 rows, gigabytes a
layer), while the steps' real contexts are usually far shorter. Graphs are captured lazily, on
the first step of each (B, W). Mixed prefill steps run without graphs.

What no CPU test covers is only `DecodeGraphs.capture` / `replay` (marked below); bucket and width
choice, padding, the static attention and the KV store's skipping of slot -1 are plain torch, tested
on CPU, and so is the whole graph path of the model runner with replay stood in for by running the
forward again on the static buffers (tests/engine/test_cuda_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from batchgen.engine.attention.kv_store import PAD_SLOT
from batchgen.engine.attention.static_decode import StaticDecode

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
MIN_GRAPH_BLOCKS = 16  # the narrowest static gather: 16 blocks (256 tokens at the 16-token blocks of this path)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs (included)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b < top] + list(range(16, top, 16))
    return sorted({*sizes, top})


def pick_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n decodes; None when none does (the step runs without a graph)."""
    return next((b for b in buckets if b >= n), None)


def pick_width(blocks: int, max_blocks: int) -> int:
    """Blocks per row of the static gather for a step whose longest row needs `blocks` (<= max_blocks):
    the next power of two from MIN_GRAPH_BLOCKS, at most max_blocks."""
    width = MIN_GRAPH_BLOCKS
    while width < blocks:
        width *= 2
    return min(width, max_blocks)


class DecodeBuffers:
    """Static inputs for the largest bucket; a bucket's graph uses their first B rows."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((max_batch,), PAD_SLOT, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(max_batch, dtype=torch.int64, device=device)
        # why a buffer: a graph reads the logit rows to keep at every replay, so they must live as
        # long as the graphs (a tensor made for one capture would be freed and its memory reused)
        self.keep = torch.arange(max_batch, device=device)

    def fill(self, n: int, bucket: int, input_ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor) -> None:
        """Rows 0..n-1 from this step (device tensors: ids [n], positions [n], tables [n, w]); n..bucket-1 padding."""
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.context_lens[:n].copy_(positions + 1)
        self.block_tables[:n].zero_()
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.context_lens[n:bucket].fill_(1)
        self.block_tables[n:bucket].zero_()
        self.slots[n:bucket].fill_(PAD_SLOT)

    def set_slots(self, n: int, block_size: int) -> None:
        """Slots of rows 0..n-1 from their tables and positions (device-side, no host values)."""
        rows = torch.arange(n, device=self.positions.device)
        pos = self.positions[:n]
        self.slots[:n] = self.block_tables[rows, pos // block_size] * block_size + pos % block_size

    def view(self, bucket: int, width: int | None = None) -> StaticDecode:
        """The first `bucket` rows and `width` blocks of each (all blocks when None)."""
        return StaticDecode(self.block_tables[:bucket, :width], self.context_lens[:bucket])


GraphKey = tuple[int, int]  # (rows B, blocks per row W)


class DecodeGraphs:  # pragma: no cover - needs CUDA; the only part of this module no CPU test runs
    """One CUDA graph per (bucket, width) over `forward(input_ids, positions, keep) -> logits [B, V]`."""

    def __init__(self, forward: Callable[..., torch.Tensor], buffers: DecodeBuffers) -> None:
        self.forward, self.buffers = forward, buffers
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.out: torch.Tensor | None = None  # [max batch, V] logits every graph writes its rows into
        self.pool: Any = None  # the graphs share one memory pool

    def step_call(self, bucket: int) -> Callable[[], torch.Tensor]:
        """The forward of `bucket` rows, reading nothing but the static buffers."""
        buf = self.buffers
        return lambda: self.forward(buf.input_ids[:bucket], buf.positions[:bucket], buf.keep[:bucket])

    def capture(self, key: GraphKey, run: Callable[[Callable[[], torch.Tensor]], torch.Tensor]) -> None:
        """Capture the forward for key's rows; `run` sets the step's context (with its width) around the call.

        Why one output buffer: each graph's own logits [B, V] would stay allocated in the shared
        pool for the graph's life (up to ~8 widths a bucket); copied into `out`, they are freed."""
        bucket, call = key[0], self.step_call(key[0])
        warm = run(call)  # warm-up outside the graph (allocator, lazy inits, compiling)
        if self.out is None:  # one model: the same vocabulary and dtype for every key
            self.out = warm.new_empty(self.buffers.keep.shape[0], *warm.shape[1:])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.out[:bucket].copy_(run(call))
        self.pool = graph.pool()
        self.graphs[key] = graph

    def replay(self, key: GraphKey, n: int) -> torch.Tensor:
        self.graphs[key].replay()
        return self.out[:n]  # type: ignore[index]  # set by the first capture


class GraphDecode:  # pragma: no cover - needs CUDA (its CPU-testable pieces are above)
    """The model runner's decode-only steps on CUDA: fill the static buffers, replay the bucket's graph."""

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.buckets = decode_buckets(max_num_seqs)
        self.buffers = DecodeBuffers(self.buckets[-1], max_blocks, device)
        self.graphs = DecodeGraphs(forward, self.buffers)
        # why: a graph's static gather holds rows x width blocks of one layer; up to the pool's own
        # size it fits the gather headroom the KV budget keeps (memory.GATHER_LAYERS_HEADROOM), beyond
        # it (one long row among many short ones) the step runs eagerly, gathering by length groups
        self.max_gather_blocks = kv_caches[0][0].shape[0] - 1  # the pool's blocks, less the trash block
        self.disabled = False  # a capture failed (e.g. a model with data-dependent Python): eager from then on
        # why counted: each capture syncs the device and runs the forward twice, so a capture inside a
        # timed window (or mid-job) is a pause; the GPU check asserts none happen while it times
        self.captures = 0  # capture attempts, failed ones included

    def execute(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        run: Callable[[object, Callable[[], torch.Tensor]], torch.Tensor],
        make_context: Callable[[torch.Tensor, StaticDecode, int], object],
    ) -> torch.Tensor | None:
        """Device ids/positions [n], tables [n, w] (uploaded) -> logits [n, V], or None: no bucket fits."""
        n = input_ids.shape[0]
        bucket = pick_bucket(n, self.buckets)
        if self.disabled or bucket is None or tables.shape[1] > self.buffers.block_tables.shape[1]:
            return None
        key = (bucket, pick_width(tables.shape[1], self.buffers.block_tables.shape[1]))
        if key[0] * key[1] > self.max_gather_blocks:
            return None
        self.buffers.fill(n, bucket, input_ids, positions, tables)
        self.buffers.set_slots(n, self.block_size)
        if key not in self.graphs.graphs and not self._capture(key, run, make_context):
            return None
        return self.graphs.replay(key, n)

    def _capture(
        self,
        key: GraphKey,
        run: Callable[[object, Callable[[], torch.Tensor]], torch.Tensor],
        make_context: Callable[[torch.Tensor, StaticDecode, int], object],
    ) -> bool:
        bucket = key[0]
        self.captures += 1
        ctx = make_context(self.buffers.slots[:bucket], self.buffers.view(*key), bucket)
        try:
            self.graphs.capture(key, lambda call: run(ctx, call))
        except RuntimeError as exc:
            logger.warning("CUDA graph capture failed for %s; decode steps run without graphs: %s", key, exc)
            self.disabled = True
            return False
        return True

    @property
    def num_graphs(self) -> int:
        return len(self.graphs.graphs)
