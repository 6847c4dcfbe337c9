"""ModelRunner: owns the HF model, the paged KV pool, the attention backend and the sampler; runs a step.

A step is one call down and one result back (vLLM v1): `execute(batch)` takes the scheduler's
frozen ScheduledBatch and returns a ModelRunnerOutput; nothing it calls calls back up. It applies
the batch's diff to its persistent state, stages the forward's metadata and the draw's inputs
(sampling/sampler) for one upload, packs every chunk into one [1, T] row in the order its
attention backend plans, runs the unchanged HF model (its attention bound to that backend:
attention/interface), keeps logits (in the model's dtype) only for the sampled chunks and
prompt-logprob positions, draws, and reads everything back in one copy. It decides nothing: what runs, and who
draws from which row, is the scheduler's business. The forward runs through StepForward (eager
or compiled); on CUDA with compile and the triton backend, decode-only steps replay the CUDA
graph of their batch-size bucket (cuda/graphs). Pooling runs the same packed forward
(`pool_forward`) and gets the base model's hidden states. With LoRA (engine/lora) it loads the
adapters the step names into their slots and stages each packed token's slot in the upload.
Which backend, the thread policy, what compiling is told and whether graphs exist are the
device's Platform's answers (api/platform, engine/platforms).

Persistent state, updated only from the scheduler's diffs: the sampling rows (`batch`, with the
sampler; a runner made without one, a tensor-parallel worker's or the memory profile's, only
runs the forward) and the backend's decode rows. `drop_all` drops both and zeroes the pool.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel

from batchgen.engine.api.config import ResolvedConfig
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.api.platform import GraphReplay
from batchgen.engine.attention.decode_kv import padded_tables
from batchgen.engine.attention.interface import bind_layers
from batchgen.engine.attention.kv_store import pool_blocks
from batchgen.engine.attention.metadata import ForwardContext, StaticDecode
from batchgen.engine.attention.path import VARLEN, AttentionChoice, has_softcap
from batchgen.engine.attention.planning import int64_tensor
from batchgen.engine.core.runner_output import EMPTY_OUTPUT, ModelRunnerOutput
from batchgen.engine.core.scheduler_output import BatchUpdate, ScheduledBatch, ScheduledChunk
from batchgen.engine.lora.slots import LoRASlots
from batchgen.engine.platforms import make_backend, platform_for
from batchgen.engine.runner.compiled_forward import StepForward
from batchgen.engine.runner.models import KVSpec
from batchgen.engine.sampling.batch import SamplingBatch
from batchgen.engine.sampling.sampler import Sampler, finish_draw, prepare_draw
from batchgen.engine.staging.transfers import Transfers


class StepInputs(Protocol):
    """What the runner asks of a model's extra per-step inputs (engine/vision's VisionInputs:
    image embeddings and M-RoPE positions). Named here so the runner imports nothing above it."""

    def prepare(
        self,
        chunks: Sequence[ScheduledChunk],
        packed_end: list[int],
        num_rows: int,
        transfers: Transfers,
        ctx: ForwardContext,
    ) -> dict[int, str]: ...
    def apply(self, update: BatchUpdate) -> None: ...
    def clear(self) -> None: ...
    def decode_positions(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """A decode-only step's M-RoPE positions [3, n] (host), or None: the model reads the KV positions."""


logger = logging.getLogger(__name__)


class ModelRunner:
    vision: StepInputs | None = None  # a vision-language model's image state (engine/vision), set after init
    _step_errors: dict[int, str] = {}  # noqa: RUF012  # this step's failed requests (read-only default)

    def __init__(
        self,
        model: PreTrainedModel,
        spec: KVSpec,
        config: ResolvedConfig,
        num_kv_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        cuda_graphs: bool | None = None,
        sampler: Sampler | None = None,
        lora: LoRASlots | None = None,
    ) -> None:
        """`config`: the step limits, the resolved attention backend and compile setting.
        `cuda_graphs`: decode steps replay graphs captured now, where the device and the backend
        allow (CUDA, a backend that reads the pool in place); None: with `config.compile`.
        `sampler`: the step's draws (None: a runner that only runs the forward). `lora`: the
        adapter slots installed in `model` (engine/lora), loaded and told each token's slot per step."""
        self.model = model
        self.lora = lora
        self.block_size = block_size = config.block_size
        self.num_kv_blocks = num_kv_blocks
        self.device = device
        shape = (pool_blocks(num_kv_blocks), block_size, spec.num_kv_heads, spec.head_dim)  # + the trash block
        # why zeros: padded decode rows read unwritten slots; masked-out garbage NaNs would still
        # poison the output (0 * NaN), zeros cannot
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(spec.num_layers)
        ]
        self.platform = platform_for(device)
        name = config.attention_backend
        softcap = has_softcap(model.config)
        self.attention: AttentionChoice = self.platform.attention_path(name, dtype, block_size, spec.head_dim, softcap)
        self.flash = self.attention.path == VARLEN
        self.backend = make_backend(config, model, self.kv_caches, device, dtype)
        self.backend.flash = self.flash
        bind_layers(model, self.backend)
        self.transfers = Transfers(device)
        self.sampler = sampler
        # the rows' sampling state; its inputs ride in the step's upload
        self.batch = SamplingBatch(device, sampler.features, self.transfers) if sampler is not None else None
        self.step_hook = self.platform.step_hook()  # on the CPU: torch's threads follow the machine's load
        # on_compiled: the hook forgets the load while compiling (ours, not the neighbours')
        policy = self.platform.compile_policy()
        self.forward = StepForward(model, config, self.backend.take_raised, self.step_hook.forget, policy)
        # CUDA graphs for decode-only steps go with compile (both are about launch overhead), all
        # captured now: none in the middle of a job (cuda/graphs)
        self.graphs: GraphReplay | None = None
        wants_graphs = config.compile if cuda_graphs is None else cuda_graphs
        if wants_graphs and self.backend.replays_static_decode:
            rows, max_blocks = config.max_num_seqs, math.ceil(config.max_model_len / block_size)
            rope_axes = int(getattr(model, "rope_axes", 0))  # a VLM's M-RoPE positions (engine/vision)
            self.graphs = self.platform.decode_graphs(self.forward, rows, max_blocks, block_size, rope_axes)
        if self.graphs is not None:  # pragma: no cover - CUDA
            self.graphs.capture_all(self._graph_run, self._graph_context)
        logger.info(
            "KV pool: %d blocks x %d tokens, %d layers (attention: %s, %s; backend: %s)",
            num_kv_blocks,
            block_size,
            spec.num_layers,
            self.attention.path,
            self.attention.reason,
            self.backend.describe(),
        )

    def execute(self, batch: ScheduledBatch) -> ModelRunnerOutput:
        """One step: the diff applied, the draw's inputs staged, one upload, one forward over the
        chunks, the draw, one read. Without a sampler, the forward alone (an empty output)."""
        chunks = batch.chunks
        if not chunks:
            raise ValueError("execute() needs a non-empty batch")
        self.step_hook.tick()
        self.transfers.begin_step()
        if self._step_errors:  # why: a step that skips the vision path (a graph replay) reports none
            self._step_errors = {}
        self._apply(batch.update)
        if batch.lora_loads and self.lora is not None:
            self.lora.load(batch.lora_loads)
        self.copy_blocks(batch.copies)  # copy-on-write of forked samples' shared last block, before any write
        draw = None
        if self.sampler is not None and self.batch is not None:
            draw = prepare_draw(batch, self.batch, self.sampler, self.transfers)  # rides in this step's upload
        logits, num_sampled = self._logits(chunks)
        if draw is None or self.sampler is None:
            return EMPTY_OUTPUT
        out = finish_draw(draw, logits, num_sampled, self.sampler, self.transfers)
        if self._step_errors:
            out = dataclasses.replace(out, errors=tuple(self._step_errors.items()))
        return out

    def _logits(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor, int]:
        """The upload and the forward -> (logits [num sampled chunks + prompt-logit rows, vocab] in the
        model's dtype, the number of sampled chunks): the sampled chunks' last positions in batch
        order, then each chunk's `prompt_logits` first positions (chunks in batch order). Why not
        float32: greedy and the NaN check read bf16 logits exactly (cpu/argmax); whatever computes
        on them (sampling, penalties, logprobs) widens its own rows."""
        if self.graphs is not None and all(c.is_decode for c in chunks):  # pragma: no cover - CUDA only
            logits = self._graph_decode(chunks)
            if logits is not None:
                return logits, len(chunks)
        padded = self.forward.padded_tokens(sum(c.num_tokens for c in chunks))
        ctx, input_ids, positions, packed_end = self._pack(chunks, padded)
        if self.vision is not None:  # image embeddings and M-RoPE positions ride in this upload
            self._step_errors = self.vision.prepare(chunks, packed_end, len(input_ids), self.transfers, ctx)
        keep = [packed_end[i] - 1 for i, c in enumerate(chunks) if c.needs_sample]
        num_sampled = len(keep)
        for i, c in enumerate(chunks):
            if c.prompt_logits:  # prompt_logprobs: positions start .. start + prompt_logits - 1
                first = packed_end[i] - c.num_tokens
                keep.extend(range(first, first + c.prompt_logits))
        num_keep = len(keep)
        keep.extend([0] * (self.forward.padded_rows(num_keep) - num_keep))
        keep_idx = self.transfers.stage(int64_tensor(keep))  # [num sampled + prompt-logit rows (+ padding)]
        self.transfers.upload()
        with torch.inference_mode(), self.backend.running(ctx):
            logits = self.forward(input_ids, positions, keep_idx)
        self.check_attention_calls(ctx)
        return logits[:num_keep], num_sampled  # [num sampled + prompt-logit rows, vocab]

    def _pack(
        self, chunks: Sequence[ScheduledChunk], padded: int | None
    ) -> tuple[ForwardContext, torch.Tensor, torch.Tensor, list[int]]:
        """The one packed-forward entry of generation and pooling: the backend plans the step and
        the chunks' tokens are packed in its order, staged for the upload -> (its context, input ids
        [T] (padded to `padded`), positions [T], each chunk's end in the packed row)."""
        ctx, positions, order = self.backend.plan(chunks, self.transfers, padded)
        token_ids: list[int] = []
        packed_end = [0] * len(chunks)
        for i in order:
            token_ids.extend(chunks[i].token_ids)
            packed_end[i] = len(token_ids)
        if padded is not None:
            token_ids.extend([0] * (padded - len(token_ids)))
        if self.lora is not None:  # each packed token's adapter slot; padding runs the base (-1)
            slots = [s for i in order for s in [chunks[i].lora_slot] * chunks[i].num_tokens]
            self.lora.stage(self.transfers, slots + [-1] * (len(token_ids) - len(slots)))
        return ctx, self.transfers.stage(int64_tensor(token_ids)), positions, packed_end

    def pool_forward(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Pooling's step: the diff applied, then the base model (no LM head) over the packed
        chunks, eager -> (hidden states [T, H], each chunk's end in the packed row)."""
        if not batch.chunks:
            raise ValueError("pool_forward() needs a non-empty batch")
        self.step_hook.tick()
        self.transfers.begin_step()
        self._apply(batch.update)
        ctx, input_ids, positions, ends = self._pack(batch.chunks, None)
        self.transfers.upload()
        with torch.inference_mode(), self.backend.running(ctx):
            out = self.model.base_model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        self.check_attention_calls(ctx)
        return out.last_hidden_state[0], ends  # [T, H]

    def check_request(self, seq_id: int, params: SamplingParams) -> str | None:
        """Why the sampler cannot serve a request's logits features (ids, grammar), or None."""
        features = self.sampler.features if self.sampler is not None else None
        if features is None or not params.uses_logits_features:
            return None
        return features.check(seq_id, params)

    def check_attention_calls(self, ctx: ForwardContext) -> None:
        """A forward must have run batchgen's attention once per layer (else K/V went unwritten)."""
        if ctx.num_attention_calls != len(self.kv_caches):
            raise RuntimeError(
                f"the model called batchgen's attention {ctx.num_attention_calls} times for "
                f"{len(self.kv_caches)} layers; it does not route all attention through the interface"
            )

    def _graph_decode(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:  # pragma: no cover - CUDA
        """A decode-only step through the CUDA graph of its batch-size bucket; None: it does not fit one."""
        needed = [c.start // self.block_size + 1 for c in chunks]
        if self.graphs is None or not self.graphs.fits(len(chunks), max(needed)):
            return None  # why before staging: the eager step then stages and uploads once, not twice
        tables = padded_tables([c.block_table for c in chunks], needed, max(needed))
        ids = self.transfers.stage(int64_tensor([c.token_ids[-1] for c in chunks]))
        positions = self.transfers.stage(int64_tensor([c.start for c in chunks]))
        staged_tables = self.transfers.stage(tables)
        rope = self.vision.decode_positions(chunks) if self.vision is not None else None
        staged_rope = self.transfers.stage(rope) if rope is not None else None  # [3, n]
        if self.lora is not None:  # the bucket's padding rows keep stale slots: their logits are dropped
            self.lora.stage(self.transfers, [c.lora_slot for c in chunks])
        self.transfers.upload()

        logits = self.graphs.execute(ids, positions, staged_tables, self._graph_run, self._graph_context, staged_rope)
        return logits  # [n, vocab] in the model's dtype, as the eager path returns them

    def _graph_run(self, ctx: object, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.inference_mode(), self.backend.running(ctx):  # type: ignore[arg-type]
            return call()

    def _graph_context(self, slots: torch.Tensor, static: StaticDecode, bucket: int) -> ForwardContext:
        return ForwardContext(self.kv_caches, slots, None, [], num_tokens=bucket, static_decode=static)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: each (source, destination) block's K/V, in every layer, right behind the
        step's upload (the pairs ride in it) and so before the forward writes any K/V."""
        if not copies:
            return
        pairs = self.transfers.stage(torch.tensor(copies).T)  # [2, n] (source, destination)

        def copy() -> None:
            for k, v in self.kv_caches:  # each [num_blocks, block_size, kv_heads, head_dim]
                k[pairs[1]] = k[pairs[0]]
                v[pairs[1]] = v[pairs[0]]

        self.transfers.on_upload(copy)

    def apply(self, update: BatchUpdate) -> None:
        """A diff taken between steps (the last finished sequences of a run); a step's own comes in its batch."""
        self._apply(update)

    def _apply(self, update: BatchUpdate) -> None:
        """The scheduler's diff: finished and preempted sequences release their decode rows (a
        preempted one's K/V is recomputed, so its row is refilled) and finished ones their sampling
        rows; new ones get sampling rows."""
        if not update:
            return
        if self.batch is not None:
            self.batch.apply(update)
        if self.vision is not None:
            self.vision.apply(update)
        if update.released:
            self.backend.release(update.released)

    def drop_all(self) -> None:
        """After an aborted generate: zero the pool, drop the sampling batch and the backend's sequences.

        Why zero: a failed step may have written NaN, and a later sequence's padded reads of its
        blocks' unwritten slots would carry it into real outputs (0 * NaN).
        """
        for k, v in self.kv_caches:
            k.zero_()
            v.zero_()
        self.backend.reset()
        if self.batch is not None:
            self.batch.clear()
        if self.vision is not None:
            self.vision.clear()
