"""ModelRunner: owns the HF model and the paged KV pool; runs one packed forward per step.

It packs every scheduled chunk into one [1, T] row (one-token chunks first, so the attention
function can treat decodes as a few padded batches), builds the step's metadata tensors once,
runs the unchanged HF model under our attention implementation, and returns float32 logits only
for the sequences whose chunk reaches their last token, in batch order. It decides nothing: what
runs, and when, is the scheduler's business.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from batchgen.engine.attention import forward_context, use_flash_attn
from batchgen.engine.cascade import shared_prefix_len, worth_splitting
from batchgen.engine.decode_rows import DecodeRequest, DecodeRows, RowsView
from batchgen.engine.models import KVSpec
from batchgen.engine.scheduler import ScheduledBatch
from batchgen.engine.step_metadata import DecodeGroup, FlashMetadata, ForwardContext, PrefillChunk

logger = logging.getLogger(__name__)

CUDA_FREE_MEMORY_FRACTION = 0.85  # of free memory after loading; the rest is activation headroom
CPU_CAPACITY_FACTOR = 2  # CPU pool: at most 2x what max_num_seqs full-length sequences need
# Decode grouping (see split_decodes): measured on CPU, 4 groups over 64 mixed-length decodes
# halve the gather + attention time of one padded group; more groups gain nothing.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8
DECODE_MERGE_RATIO = 1.25


@dataclass
class Chunk:
    """One sequence's chunk in packed order: positions context_start .. context_start + num_tokens - 1."""

    context_start: int
    num_tokens: int
    block_table: list[int]


def num_kv_blocks_for(
    spec: KVSpec, block_size: int, dtype: torch.dtype, device: torch.device, *, num_kv_blocks: int | None,
    budget_bytes: int | None, max_num_seqs: int, max_model_len: int,
) -> int:
    """Pool size: explicit blocks, else a byte budget, else (CUDA) free memory, else a CPU default."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    elem = torch.tensor([], dtype=dtype).element_size()
    bytes_per_block = 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem
    if budget_bytes is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget_bytes = int(free * CUDA_FREE_MEMORY_FRACTION)
    if budget_bytes is None:
        budget_bytes = 1 << 30
        # why: on CPU a default 1 GiB of zeros would be touched for nothing beyond this many blocks
        cap = CPU_CAPACITY_FACTOR * max_num_seqs * math.ceil(max_model_len / block_size)
        return max(1, min(budget_bytes // bytes_per_block, cap))
    blocks = budget_bytes // bytes_per_block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget_bytes} bytes is below one block ({bytes_per_block} bytes)")
    return blocks


def split_decodes(blocks: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive decodes' sizes (blocks or tokens) -> groups (start, end, largest size).

    Best for decodes sorted by length. Equal-count groups of at least MIN_DECODE_GROUP rows, at most MAX_DECODE_GROUPS; a group
    joins the previous one when that would pad it by little (its longest row is at most
    DECODE_MERGE_RATIO times the previous group's), since each group costs a gather and an
    attention call per layer.
    """
    m = len(blocks)
    if m == 0:
        return []
    count = max(1, min(MAX_DECODE_GROUPS, m // MIN_DECODE_GROUP))
    bounds = [round(i * m / count) for i in range(count + 1)]
    groups: list[tuple[int, int, int]] = []
    for a, b in zip(bounds, bounds[1:]):
        longest = max(blocks[a:b])
        if groups and longest <= DECODE_MERGE_RATIO * groups[-1][2]:
            groups[-1] = (groups[-1][0], b, max(longest, groups[-1][2]))
        else:
            groups.append((a, b, longest))
    return groups


def build_forward_context(
    chunks: list[Chunk], kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
    device: torch.device, flash: bool = False, rows: RowsView | None = None,
) -> tuple[ForwardContext, torch.Tensor]:
    """Step metadata for `chunks` (one-token chunks first) -> (context, positions [T]).

    With `rows`, the one-token chunks read their K/V from decode rows (in `rows`' order), not blocks.
    """
    num_dec = next((i for i, c in enumerate(chunks) if c.num_tokens != 1), len(chunks))
    if any(c.num_tokens == 1 for c in chunks[num_dec:]):
        raise ValueError("one-token chunks must come first in the packed order")
    needed = [math.ceil((c.context_start + c.num_tokens) / block_size) for c in chunks]
    short = [i for i, (c, n) in enumerate(zip(chunks, needed)) if len(c.block_table) < n]
    if short:  # why: a missing block would silently alias block 0 (another sequence's K/V)
        raise RuntimeError(f"chunks {short[:5]} have fewer KV blocks than their tokens need")
    max_blocks = max(needed)
    # [N, max_blocks]; padding points at block 0, which masks always hide
    tables = torch.tensor([c.block_table[:n] + [0] * (max_blocks - n) for c, n in zip(chunks, needed)])
    lens = torch.tensor([c.num_tokens for c in chunks])  # [N]
    ctx_start = torch.tensor([c.context_start for c in chunks])  # [N]
    cu = torch.cumsum(lens, 0) - lens  # [N] packed offset of each chunk
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), lens)  # [T]
    positions = torch.arange(int(lens.sum())) - cu[seq_of_token] + ctx_start[seq_of_token]  # [T]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size  # [T]
    if rows is None:
        decodes = _gather_groups(needed[:num_dec], tables, ctx_start, block_size, device)
    else:
        decodes = _row_groups(rows, tables, ctx_start, block_size, device)
    starts = cu.tolist()
    prefills = [
        PrefillChunk(start=starts[i], end=starts[i] + c.num_tokens, context_start=c.context_start,
                     block_table=tables[i, :needed[i]].to(device))
        for i, c in enumerate(chunks) if i >= num_dec
    ]
    meta = _flash_metadata(lens, ctx_start, tables, device) if flash else None
    ctx = ForwardContext(kv_caches=kv_caches, slot_mapping=slots.to(device), decodes=decodes,
                         prefills=prefills, flash=meta, rows=rows)
    return ctx, positions.to(device)


def _gather_groups(blocks: list[int], tables: torch.Tensor, ctx_start: torch.Tensor, block_size: int,
                   device: torch.device) -> list[DecodeGroup]:
    """Decode groups that gather their K/V from the pool: the first len(blocks) chunks are decodes."""
    return [
        DecodeGroup(start=a, num_seqs=b - a, gather_index=tables[a:b, :mb].flatten().to(device), rows=None,
                    context_lens=(ctx_start[a:b] + 1).to(device), kv_len=mb * block_size)
        for a, b, mb in split_decodes(blocks)
    ]


def _row_groups(rows: RowsView, tables: torch.Tensor, ctx_start: torch.Tensor, block_size: int,
                device: torch.device) -> list[DecodeGroup]:
    """One decode group per length class of the rows; the decodes are packed class by class.

    A group whose sequences share their first cached blocks (prefix caching) is marked for
    cascade attention when that pays (see cascade.py).
    """
    groups, first = [], 0
    for step in rows.classes:
        n = step.positions.numel()
        lens = ctx_start[first:first + n] + 1  # [n]
        kv_len = int(lens.max())
        shared = shared_prefix_len(tables[first:first + n], ctx_start[first:first + n], block_size)
        groups.append(DecodeGroup(start=first, num_seqs=n, gather_index=None, rows=step,
                                  context_lens=lens.to(device), kv_len=kv_len,
                                  shared_len=shared if worth_splitting(shared, kv_len, n) else 0))
        first += n
    return groups


def _flash_metadata(
    lens: torch.Tensor, ctx_start: torch.Tensor, tables: torch.Tensor, device: torch.device
) -> FlashMetadata:
    zero = torch.zeros(1, dtype=torch.int32)
    kv_lens = ctx_start + lens
    return FlashMetadata(
        cu_seqlens_q=torch.cat([zero, torch.cumsum(lens, 0).int()]).to(device),
        cu_seqlens_k=torch.cat([zero, torch.cumsum(kv_lens, 0).int()]).to(device),
        max_seqlen_q=int(lens.max()), max_seqlen_k=int(kv_lens.max()),
        block_tables=tables.int().to(device),
    )


def packing_order(batch: ScheduledBatch) -> list[int]:
    """Batch indices in packed order: one-token chunks first, shortest context first.

    A layout choice, not a policy: the attention groups decodes of similar length (split_decodes).
    Stable, so ties keep batch order.
    """
    def key(i: int) -> tuple[bool, int]:
        decode = batch.num_new_tokens[i] == 1
        return (not decode, batch.seqs[i].num_computed_tokens if decode else 0)

    return sorted(range(len(batch.seqs)), key=key)


class ModelRunner:
    def __init__(
        self, model: PreTrainedModel, spec: KVSpec, block_size: int, num_kv_blocks: int,
        device: torch.device, dtype: torch.dtype, max_num_seqs: int | None = None, max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.device = device
        shape = (num_kv_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        # why zeros: padded decode rows read unwritten slots; masked-out garbage NaNs would still
        # poison the output (0 * NaN), zeros cannot
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(spec.num_layers)
        ]
        self.flash = use_flash_attn(device, block_size)
        # why CPU only: there a decode step is memory-bound and gathering blocks every step
        # dominated it; on a GPU the gather is cheap and rows would cost GPU memory
        self.rows = (DecodeRows(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size,
                                max_model_len or num_kv_blocks * block_size, dtype, device, max_num_seqs,
                                num_kv_blocks * block_size)
                     if device.type == "cpu" else None)
        logger.info("KV pool: %d blocks x %d tokens, %d layers (%s)", num_kv_blocks, block_size,
                    spec.num_layers, "flash-attn" if self.flash else "torch SDPA")

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward over the batch -> float32 logits [num sampled seqs, vocab], in batch order."""
        n = len(batch.seqs)
        if n == 0:
            raise ValueError("execute() needs a non-empty batch")
        order = packing_order(batch)
        rows = None
        if self.rows is not None:
            order, rows = self._plan_rows(batch, order)
        chunks, token_ids, packed_end = [], [], [0] * n
        for i in order:
            seq, count = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            chunks.append(Chunk(start, count, seq.block_table))
            token_ids.extend(seq.token_ids[start:start + count])
            packed_end[i] = len(token_ids)
        keep = [packed_end[i] - 1 for i in range(n) if batch.needs_sample(i)]
        ctx, positions = build_forward_context(chunks, self.kv_caches, self.block_size, self.device, self.flash,
                                               rows)
        input_ids = torch.tensor(token_ids, device=self.device)[None]  # [1, T]
        keep_idx = torch.tensor(keep, dtype=torch.long, device=self.device)  # [num sampled]
        with torch.inference_mode(), forward_context(ctx):
            out = self.model(input_ids=input_ids, position_ids=positions[None], logits_to_keep=keep_idx,
                             use_cache=False)
        if ctx.num_attention_calls != len(self.kv_caches):
            raise RuntimeError(
                f"the model called batchgen's attention {ctx.num_attention_calls} times for "
                f"{len(self.kv_caches)} layers; it does not route all attention through the interface"
            )
        return out.logits[0].float()  # [num sampled, vocab]

    def _plan_rows(self, batch: ScheduledBatch, order: list[int]) -> tuple[list[int], RowsView]:
        """Give this step's one-token chunks their decode rows; pack them in the rows' order."""
        assert self.rows is not None
        decodes = [i for i in order if batch.num_new_tokens[i] == 1]
        requests = [DecodeRequest(batch.seqs[i].seq_id, batch.seqs[i].num_computed_tokens, batch.seqs[i].block_table)
                    for i in decodes]
        packed, view = self.rows.plan(requests)
        return [decodes[j] for j in packed] + order[len(decodes):], view
