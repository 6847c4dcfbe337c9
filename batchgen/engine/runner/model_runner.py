"""ModelRunner: owns the HF model, the paged KV pool and the decode K/V source; runs one packed forward per step.

It packs every scheduled chunk into one [1, T] row (decodes first, in the order their K/V source
planned them, so the attention function can treat them as a few padded groups), builds the
step's metadata tensors once, runs the unchanged HF model under our attention implementation,
and returns float32 logits only for the chunks that need a sample, in batch order. It reads the
scheduler's frozen chunks, never live sequence state, and decides nothing: what runs, and when,
is the scheduler's business. The step's metadata is staged in the runner's Transfers and sent in
one upload (see transfers); the forward runs through StepForward (eager or compiled, tokens
padded to a multiple of 8 when compiled), and on CUDA with compile, decode-only steps replay a
CUDA graph per batch-size bucket (cuda_graphs).

It keeps the runner side's persistent state, updated only from the scheduler's diffs (`apply`,
which `execute` runs first): the sampling batch (`batch`, per-row sampling state the engine's
sampler reads) and the decode K/V source's rows, released when their sequences finish or are
preempted. `drop_all` drops both, and zeroes the pool, after an aborted generate.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from batchgen.engine.attention.decode_kv import (
    DecodeKVSource,
    DecodeRequest,
    DecodeStep,
    padded_tables,
    resolve_decode_kv,
)
from batchgen.engine.attention.gather import GatheredBlocks
from batchgen.engine.attention.kv_store import PAD_SLOT, pool_blocks
from batchgen.engine.attention.metadata import FlashMetadata, ForwardContext, PrefillChunk
from batchgen.engine.attention.paged import forward_context
from batchgen.engine.attention.path import VARLEN, AttentionChoice, choose_attention_path, detect_support, has_softcap
from batchgen.engine.core.scheduler import BatchUpdate, ScheduledBatch, ScheduledChunk
from batchgen.engine.cpu import native, native_ops
from batchgen.engine.cpu.decode_native import kernels_for
from batchgen.engine.cpu.decode_rows import DecodeRows
from batchgen.engine.cpu.front import decode_plan
from batchgen.engine.cpu.front import load as load_front
from batchgen.engine.cpu.native_linear import install_native_linears
from batchgen.engine.cuda.graphs import GraphDecode, StaticDecode
from batchgen.engine.runner.compiled_forward import StepForward
from batchgen.engine.runner.models import KVSpec
from batchgen.engine.runner.transfers import Transfers, int64_tensor
from batchgen.engine.sampling.batch import SamplingBatch

logger = logging.getLogger(__name__)


def _packed_order(
    chunks: Sequence[ScheduledChunk],
    decode_kv: DecodeKVSource,
    flash: bool,
) -> tuple[list[int], DecodeStep | None, int]:
    """Chunk indices in packed order (decodes as their source plans them, then the rest in batch
    order), the decodes' step and their number. With the varlen kernel every chunk reads the pool:
    nothing is planned."""
    decodes = [] if flash else [i for i, c in enumerate(chunks) if c.is_decode]
    if not decodes:
        return list(range(len(chunks))), None, 0
    packed, step = decode_kv.plan(
        # why the chunk's max_len: the decode rows size a row for the longest it may grow
        [DecodeRequest(chunks[i].seq_id, chunks[i].start, chunks[i].block_table, chunks[i].max_len) for i in decodes]
    )
    rest = [i for i, c in enumerate(chunks) if not c.is_decode]
    return [decodes[j] for j in packed] + rest, step, len(decodes)


def build_forward_context(
    chunks: Sequence[ScheduledChunk],
    decode_kv: DecodeKVSource,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_size: int,
    device: torch.device,
    flash: bool = False,
    *,
    transfers: Transfers | None = None,
    padded_len: int | None = None,
) -> tuple[ForwardContext, torch.Tensor, list[int]]:
    """Step metadata for `chunks` (batch order) -> (context, positions [T], packed order of the chunks).

    Every tensor is staged in `transfers` (uploaded by the caller in one copy before the forward).
    `padded_len` >= the step's tokens pads positions (0) and the slot mapping (-1, not stored).
    """
    transfers = transfers or Transfers(device)
    order, step, num_dec = _packed_order(chunks, decode_kv, flash)
    packed = [chunks[i] for i in order]
    needed = [math.ceil((c.start + c.num_tokens) / block_size) for c in packed]
    short = [order[j] for j, (c, n) in enumerate(zip(packed, needed)) if len(c.block_table) < n]
    if short:  # why: a missing block would silently alias block 0 (another sequence's K/V)
        raise RuntimeError(f"chunks {short[:5]} have fewer KV blocks than their tokens need")
    if num_dec == len(packed):  # decodes only (never with the varlen kernel, which plans none)
        positions, slots = decode_slots(packed, block_size, padded_len)
        ctx = ForwardContext(kv_caches, transfers.stage(slots), step, [], num_tokens=len(packed))
        return ctx, transfers.stage(positions), order
    max_blocks = max(needed)
    tables = padded_tables([c.block_table for c in packed], needed, max_blocks)  # [N, max_blocks]
    lens = int64_tensor([c.num_tokens for c in packed])  # [N]
    ctx_start = int64_tensor([c.start for c in packed])  # [N]
    cu = torch.cumsum(lens, 0) - lens  # [N] packed offset of each chunk
    num_tokens = int(cu[-1] + lens[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(packed)), lens)  # [T]
    positions = torch.arange(num_tokens) - cu[seq_of_token] + ctx_start[seq_of_token]  # [T]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size  # [T]
    pad = (padded_len or num_tokens) - num_tokens
    if pad > 0:
        positions = torch.cat([positions, positions.new_zeros(pad)])
        slots = torch.cat([slots, slots.new_full((pad,), PAD_SLOT)])
    starts = cu.tolist()
    prefills = (
        []
        if flash
        else [  # why: the varlen kernel needs none of it (and no per-chunk copies)
            PrefillChunk(
                start=starts[j],
                end=starts[j] + c.num_tokens,
                context_start=c.start,
                block_table=transfers.stage(tables[j, : needed[j]]),
            )
            for j, c in enumerate(packed)
            if j >= num_dec
        ]
    )
    meta = _flash_metadata(lens, ctx_start, tables, transfers) if flash else None
    ctx = ForwardContext(
        kv_caches=kv_caches,
        slot_mapping=transfers.stage(slots),
        decodes=step,
        prefills=prefills,
        flash=meta,
        num_tokens=num_tokens,
    )
    return ctx, transfers.stage(positions), order


def decode_slots(
    decodes: Sequence[ScheduledChunk], block_size: int, padded_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-token chunks -> (positions [T], slot mapping [T]), padded as build_forward_context pads.

    Why in Python: a decode step's metadata is one position and one slot per sequence, cheaper as
    list arithmetic than as the general path's tensor ops (~0.3 ms of a 64-row CPU step)."""
    positions = [c.start for c in decodes]
    slots = [c.block_table[p // block_size] * block_size + p % block_size for c, p in zip(decodes, positions)]
    pad = (padded_len or len(positions)) - len(positions)
    return int64_tensor(positions + [0] * pad), int64_tensor(slots + [PAD_SLOT] * pad)


def _flash_metadata(
    lens: torch.Tensor, ctx_start: torch.Tensor, tables: torch.Tensor, transfers: Transfers
) -> FlashMetadata:
    """lens/ctx_start [N] (packed order), tables [N, max_blocks] -> the varlen kernel's metadata
    (int64 as staged; the kernel's call casts to int32 after the upload)."""
    zero = torch.zeros(1, dtype=torch.int64)
    kv_lens = ctx_start + lens  # [N] keys each chunk attends over: its cached context and itself
    return FlashMetadata(
        cu_seqlens_q=transfers.stage(torch.cat([zero, torch.cumsum(lens, 0)])),
        cu_seqlens_k=transfers.stage(torch.cat([zero, torch.cumsum(kv_lens, 0)])),
        max_seqlen_q=int(lens.max()),
        max_seqlen_k=int(kv_lens.max()),
        block_tables=transfers.stage(tables),
        seqused_k=transfers.stage(kv_lens),
    )


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        spec: KVSpec,
        block_size: int,
        num_kv_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        decode_kv: str = "auto",
        compile: bool = False,
        max_num_batched_tokens: int | None = None,
        compile_fallback: bool = False,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.device = device
        shape = (pool_blocks(num_kv_blocks), block_size, spec.num_kv_heads, spec.head_dim)  # + the trash block
        # why zeros: padded decode rows read unwritten slots; masked-out garbage NaNs would still
        # poison the output (0 * NaN), zeros cannot
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(spec.num_layers)
        ]
        if device.type == "cpu" and (missing := native_ops.pending()):
            logger.warning(
                "building the native CPU kernels for this machine before the first step (%s; %s, once per machine;"
                " `batchgen doctor --build` builds them ahead of a job)",
                ", ".join(missing),
                native.BUILD_SECONDS,
            )
        self.attention: AttentionChoice = choose_attention_path(
            device.type, dtype, block_size, spec.head_dim, has_softcap(model.config), detect_support(device)
        )
        self.flash = self.attention.path == VARLEN
        self.decode_kv_kind = resolve_decode_kv(decode_kv, device)
        self.decode_kv: DecodeKVSource = (
            DecodeRows(
                spec.num_layers,
                spec.num_kv_heads,
                spec.head_dim,
                block_size,
                max_model_len or num_kv_blocks * block_size,
                dtype,
                device,
                max_num_seqs,
                num_kv_blocks * block_size,
                kernels_for(model.config, device, dtype),
            )
            if self.decode_kv_kind == "rows"
            else GatheredBlocks(block_size, device)
        )
        # the C++ front attends decode-only steps of the native kernel without Python per layer
        self.front = isinstance(self.decode_kv, DecodeRows) and self.decode_kv.native is not None and load_front()
        self._num_heads = model.config.get_text_config().num_attention_heads
        self.transfers = Transfers(device)
        self.decode_kv.stage = self.transfers.stage
        # why a lambda: a test may swap `transfers`; the batch's uploads follow it
        self.batch = SamplingBatch(device, to_device=lambda t: self.transfers.to_device(t))
        self.native_linears = install_native_linears(model, device, dtype)
        self.forward = StepForward(model, compile, max_num_batched_tokens, fallback=compile_fallback)
        # CUDA graphs for decode-only steps go with compile (both are about launch overhead)
        self.graphs: GraphDecode | None = None
        if device.type == "cuda" and compile and not self.flash:  # pragma: no cover - CUDA only
            max_blocks = math.ceil((max_model_len or num_kv_blocks * block_size) / block_size)
            self.graphs = GraphDecode(self.forward, self.kv_caches, max_num_seqs or 64, max_blocks, block_size, device)
        logger.info(
            "KV pool: %d blocks x %d tokens, %d layers (attention: %s, %s; decode K/V: %s%s)",
            num_kv_blocks,
            block_size,
            spec.num_layers,
            self.attention.path,
            self.attention.reason,
            self.decode_kv_kind,
            ", native kernel through the C++ front" if self.front else "",
        )

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward over the batch -> float32 logits [num sampled chunks + prompt-logit rows, vocab]:
        the sampled chunks' last positions in batch order, then each chunk's `prompt_logits` first
        positions (chunks in batch order)."""
        chunks = batch.chunks
        if not chunks:
            raise ValueError("execute() needs a non-empty batch")
        self.apply(batch.update)
        self.copy_blocks(batch.copies)  # copy-on-write of forked samples' shared last block, before any write
        if self.graphs is not None and all(c.is_decode for c in chunks):  # pragma: no cover - CUDA only
            logits = self._graph_decode(chunks)
            if logits is not None:
                return logits
        padded = self.forward.padded_tokens(sum(c.num_tokens for c in chunks))
        ctx, positions, order = build_forward_context(
            chunks,
            self.decode_kv,
            self.kv_caches,
            self.block_size,
            self.device,
            self.flash,
            transfers=self.transfers,
            padded_len=padded,
        )
        token_ids: list[int] = []
        packed_end = [0] * len(chunks)
        for i in order:
            token_ids.extend(chunks[i].token_ids)
            packed_end[i] = len(token_ids)
        keep = [packed_end[i] - 1 for i, c in enumerate(chunks) if c.needs_sample]
        for i, c in enumerate(chunks):
            if c.prompt_logits:  # prompt_logprobs: positions start .. start + prompt_logits - 1
                first = packed_end[i] - c.num_tokens
                keep.extend(range(first, first + c.prompt_logits))
        num_keep = len(keep)
        token_ids.extend([0] * (padded - len(token_ids)))
        keep.extend([0] * (self.forward.padded_rows(num_keep) - num_keep))
        input_ids = self.transfers.stage(int64_tensor(token_ids))  # [T]
        keep_idx = self.transfers.stage(int64_tensor(keep))  # [num sampled + prompt-logit rows (+ padding)]
        self.transfers.upload()
        with torch.inference_mode(), forward_context(ctx), decode_plan(ctx, self._num_heads):
            logits = self.forward(input_ids, positions, keep_idx)
        if ctx.num_attention_calls != len(self.kv_caches):
            raise RuntimeError(
                f"the model called batchgen's attention {ctx.num_attention_calls} times for "
                f"{len(self.kv_caches)} layers; it does not route all attention through the interface"
            )
        return logits[:num_keep].float()  # [num sampled + prompt-logit rows, vocab]

    def _graph_decode(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:  # pragma: no cover - CUDA
        """A decode-only step through the CUDA graph of its batch-size bucket; None: it does not fit one."""
        if self.graphs is None:
            return None
        needed = [c.start // self.block_size + 1 for c in chunks]
        tables = padded_tables([c.block_table for c in chunks], needed, max(needed))
        ids = self.transfers.stage(int64_tensor([c.token_ids[-1] for c in chunks]))
        positions = self.transfers.stage(int64_tensor([c.start for c in chunks]))
        staged_tables = self.transfers.stage(tables)
        self.transfers.upload()

        def run(ctx: object, call: Callable[[], torch.Tensor]) -> torch.Tensor:
            with torch.inference_mode(), forward_context(ctx):  # type: ignore[arg-type]
                return call()

        def context(slots: torch.Tensor, static: StaticDecode, bucket: int) -> ForwardContext:
            return ForwardContext(self.kv_caches, slots, None, [], num_tokens=bucket, static_decode=static)

        logits = self.graphs.execute(ids, positions, staged_tables, run, context)
        return None if logits is None else logits.float()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's K/V, in every layer."""
        if not copies:
            return
        pairs = self.transfers.to_device(torch.tensor(copies).T)  # [2, n] (source, destination); counted: one upload
        for k, v in self.kv_caches:  # each [num_blocks, block_size, kv_heads, head_dim]
            k[pairs[1]] = k[pairs[0]]
            v[pairs[1]] = v[pairs[0]]

    def apply(self, update: BatchUpdate) -> None:
        """The scheduler's diff: finished and preempted sequences release their decode rows (a
        preempted one's K/V is recomputed, so its row is refilled) and finished ones their sampling
        rows; new ones get sampling rows."""
        if not update:
            return
        self.batch.apply(update)
        released = update.released
        if released:
            self.decode_kv.release(released)

    def drop_all(self) -> None:
        """After an aborted generate: zero the pool, drop the sampling batch and the decode rows.

        Why zero: a failed step may have written NaN, and a later sequence's padded reads of its
        blocks' unwritten slots would carry it into real outputs (0 * NaN).
        """
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()
        self.decode_kv.reset()
        self.batch.clear()
