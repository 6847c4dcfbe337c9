"""The runner side of images: which sequences have which images, the encoder cache, and each
step's splice (which packed rows take which image embeddings) and M-RoPE positions.

Why here, updated from the scheduler's diffs: a sequence's images arrive once, in the
NewSequence of its first step (RequestExtras plus the images themselves), and its chunks then
name only positions. A chunk that covers an image's tokens needs that image's embeddings: the
tower runs for every such image not yet cached, all of a step's new images in one batched call,
right behind the step's upload (their pixels ride in it). The embeddings stay in the encoder
cache (keyed by content hash, so two requests with the same image share one run) until every
sequence that needs them has prefilled past the image, so a chunk cut through an image or a
partial prefix hit never reruns the tower, unless the cache's cap evicted them meanwhile
(vision/encoder_cache): then the tower runs on the image again when a chunk needs it. A
preempted sequence claims its images again for its recomputation.

Pixels are decoded here, when the image's tokens are first scheduled (at most the scheduler's
max_decoded_pixels a step), and dropped once the processor has read them; an image that cannot be
decoded fails its request (the step's `errors`), never the step, and every later request with
the same content hash fails alike (its blocks may be in the prefix cache, computed without it).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from batchgen.engine.attention.metadata import ForwardContext
from batchgen.engine.core.scheduler_output import BatchUpdate, ScheduledChunk
from batchgen.engine.staging.transfers import Transfers
from batchgen.engine.vision.encoder_cache import EncoderCache
from batchgen.engine.vision.images import ImageDecodeError, RequestImage
from batchgen.engine.vision.model import SpliceStep, VisionLanguageLM
from batchgen.engine.vision.prompts import rotary_delta
from batchgen.engine.vision.tower import VisionTower

logger = logging.getLogger(__name__)
ZERO = torch.zeros(1, dtype=torch.int64)


@dataclass
class _SeqImages:
    images: tuple[RequestImage, ...]
    spans: tuple[tuple[int, int], ...]  # (first position, count) per image
    rotary: torch.Tensor | None  # M-RoPE positions of the prompt [3, prompt tokens] (built once), or None
    num_prompt: int
    atomic: bool = False  # its images' tokens attend both ways (Gemma 3)
    delta: int = 0  # M-RoPE: what a generated token's index gains
    done: set[int] = field(default_factory=set)  # images this sequence has prefilled past
    images_end: int = field(init=False)  # the position past its last image (a chunk from there splices nothing)

    def __post_init__(self) -> None:
        self.images_end = max((s + count for s, count in self.spans), default=0)


class VisionInputs:
    """The runner's image state; `prepare` builds one step's SpliceStep (see the module docstring)."""

    def __init__(
        self, lm: VisionLanguageLM, tower: VisionTower, mrope: bool, cache_tokens: int, auto_cap: bool = True
    ) -> None:
        self.lm = lm
        self.tower = tower
        self.mrope = mrope
        self.seqs: dict[int, _SeqImages] = {}
        self.cache = EncoderCache(cache_tokens, auto_cap)  # content hash -> embeddings [tokens, hidden]
        # content hash -> sequences still to prefill it (with how many of their images have it)
        self.claims: dict[bytes, Counter[int]] = {}
        self.failed: dict[bytes, str] = {}  # content hash -> why it cannot be decoded (Pillow's words)
        self.tower_runs = 0  # images encoded (tests: a cut or a prefix hit never reruns one)
        self.peak_decoded_pixels = 0  # the most pixels one step held decoded (tests, benchmarks)
        self._tower_call: list[RequestImage] = []  # this step's images to encode, behind the upload
        self._tower_inputs: dict[str, torch.Tensor] = {}
        self._released: set[bytes] = set()  # unclaimed in the last step: dropped at the next one
        self._counts: dict[bytes, int] = {}  # this step's images: their token counts

    def _drop_released(self) -> None:
        """Embeddings unclaimed during the last step, now that its forward has used them."""
        for content_hash in self._released:
            self._drop_if_unclaimed(content_hash)
        self._released = set()

    def apply(self, update: BatchUpdate) -> None:
        """The scheduler's diff: new sequences bring their images (in their extras)."""
        self._drop_released()  # why here too: a run's last update comes after its last step
        for new in update.new:
            extras = new.extras
            if not extras.image_hashes and not extras.rotary_positions:
                continue
            n = len(new.prompt_token_ids)
            delta = rotary_delta(extras, n) if extras.rotary_positions else 0
            # why a tensor once here: each prefill chunk then slices it, never rebuilding from Python ints
            rotary = torch.tensor(extras.rotary_positions, dtype=torch.int64) if extras.rotary_positions else None
            seq = _SeqImages(extras.images, extras.image_positions, rotary, n, extras.atomic_images, delta)
            self.seqs[new.seq_id] = seq
            self._claim(new.seq_id, seq)
            self.cache.fit(max((count for _, count in seq.spans), default=0))
        for seq_id in update.preempted:
            back = self.seqs.get(seq_id)
            if back is not None:  # its recomputation needs its images again
                for k in back.done:
                    self.claims.setdefault(back.images[k].content_hash, Counter())[seq_id] += 1
                back.done.clear()
        for seq_id in update.finished:
            gone = self.seqs.pop(seq_id, None)
            for k, image in enumerate(gone.images if gone is not None else ()):
                if gone is not None and k not in gone.done:
                    self._unclaim(image.content_hash, seq_id)

    def _claim(self, seq_id: int, seq: _SeqImages) -> None:
        for image in seq.images:
            self.claims.setdefault(image.content_hash, Counter())[seq_id] += 1

    def clear(self) -> None:
        """After an aborted generate: forget every sequence and cached embedding."""
        self._tower_call, self._tower_inputs, self._released = [], {}, set()
        self.seqs.clear()
        self.cache.clear()
        self.claims.clear()

    def prepare(
        self,
        chunks: Sequence[ScheduledChunk],
        packed_end: list[int],
        num_rows: int,
        transfers: Transfers,
        ctx: ForwardContext,
    ) -> dict[int, str]:
        """Stage this step's splice and positions and queue the tower behind the upload; set the
        LM's step; mark the images whose tokens attend both ways in the step's prefill chunks.
        -> {seq_id: error} for sequences whose images cannot be decoded."""
        self._drop_released()
        self._counts = {}
        errors: dict[int, str] = {}
        wanted: dict[bytes, RequestImage] = {}
        pieces: list[tuple[int, bytes, int, int]] = []  # (first packed row, hash, lo, hi)
        for chunk, end in zip(chunks, packed_end):
            seq = self.seqs.get(chunk.seq_id)
            if seq is None or not seq.images:
                continue
            error = self._failure(seq) if self.failed else None
            if error is not None:
                errors[chunk.seq_id] = error
                continue
            if chunk.start >= seq.images_end:  # a decode step, or a chunk past its images
                continue
            first = end - chunk.num_tokens
            for image, (s, count) in zip(seq.images, seq.spans):
                lo, hi = max(chunk.start, s), min(chunk.start + chunk.num_tokens, s + count)
                if lo >= hi:
                    continue
                self._counts[image.content_hash] = count
                if image.content_hash not in self.cache:
                    wanted[image.content_hash] = image
                pieces.append((first + lo - chunk.start, image.content_hash, lo - s, hi - s))
        keep = {h for _, h, _, _ in pieces}
        if wanted or self.cache.used > self.cache.cap:  # why the guard: else it would evict nothing, in O(entries)
            self.cache.make_room(sum(self._counts[h] for h in wanted), keep, lambda h: bool(self.claims.get(h)))
        self._decode(wanted, errors, chunks, transfers)
        self._mark_bidirectional(chunks, packed_end, ctx)
        pieces = [p for p in pieces if p[1] not in self.failed]
        step = SpliceStep()
        if pieces:
            rows = torch.cat([torch.arange(first, first + hi - lo) for first, _, lo, hi in pieces])  # [M]
            step.rows = transfers.stage(rows)
            transfers.on_upload(lambda: self._gather(step, pieces))
        if self.mrope:
            step.positions = transfers.stage(self._positions(chunks, packed_end, num_rows))[:, None]  # [3, 1, T]
        self.lm.step = step
        self._release(chunks)
        return errors

    def _decode(
        self,
        wanted: dict[bytes, RequestImage],
        errors: dict[int, str],
        chunks: Sequence[ScheduledChunk],
        transfers: Transfers,
    ) -> None:
        """Decode the wanted images and stage their pixels (the tower runs behind the upload);
        an image that cannot be decoded fails every sequence of the step that has it."""
        decoded, self._tower_call = [], []
        for content_hash, image in wanted.items():
            try:
                decoded.append(image.decode())
                self._tower_call.append(image)
            except ImageDecodeError as exc:
                logger.warning("%s", exc)
                self.failed[content_hash] = exc.reason
        held = sum(d.width * d.height for d in decoded)  # all of them at once, until the processor has run
        self.peak_decoded_pixels = max(self.peak_decoded_pixels, held)
        if len(decoded) < len(wanted):
            for chunk in chunks:
                seq = self.seqs.get(chunk.seq_id)
                error = self._failure(seq) if seq is not None else None
                if error is not None:
                    errors[chunk.seq_id] = error
        if decoded:
            inputs = self.tower.pixel_inputs(decoded)
            self._tower_inputs = {k: transfers.stage(v) for k, v in inputs.items()}

    def _mark_bidirectional(self, chunks: Sequence[ScheduledChunk], packed_end: list[int], ctx: ForwardContext) -> None:
        """Gemma 3: each prefill chunk learns the images it holds (whole: the scheduler never ends a
        chunk inside one), whose tokens the attention lets see each other both ways."""
        if not ctx.prefills:
            return
        by_start = {p.start: p for p in ctx.prefills}
        for chunk, end in zip(chunks, packed_end):
            seq = self.seqs.get(chunk.seq_id)
            if seq is None or not seq.atomic:
                continue
            prefill = by_start.get(end - chunk.num_tokens)
            if prefill is None:
                continue
            a, b = chunk.start, chunk.start + chunk.num_tokens
            prefill.bidirectional = tuple((s, s + c) for s, c in seq.spans if s < b and s + c > a)

    def _failure(self, seq: _SeqImages) -> str | None:
        """Why `seq` fails: its first image whose content could not be decoded, or None."""
        for image in seq.images:
            reason = self.failed.get(image.content_hash)
            if reason is not None:
                return f"image {image.index}: cannot decode: {reason}"
        return None

    def _gather(self, step: SpliceStep, pieces: list[tuple[int, bytes, int, int]]) -> None:
        """Behind the upload: the tower over the step's new images (one batched call), then the
        step's source rows [M, hidden] from the encoder cache."""
        if self._tower_call:
            counts = [self._counts[i.content_hash] for i in self._tower_call]
            embeds = self.tower.encode(self._tower_inputs, counts)
            for image, image_embeds in zip(self._tower_call, embeds, strict=True):
                self.cache.put(image.content_hash, image_embeds)
            self.tower_runs += len(self._tower_call)
            self._tower_call, self._tower_inputs = [], {}
        step.embeds = torch.cat([self.cache.get(h)[lo:hi] for _, h, lo, hi in pieces])

    def _release(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Claims of sequences whose chunk in this step ends past an image (freed after the gather)."""
        for chunk in chunks:
            seq = self.seqs.get(chunk.seq_id)
            if seq is None or len(seq.done) == len(seq.images):  # past all its images already
                continue
            end = chunk.start + chunk.num_tokens
            for k, (image, (s, count)) in enumerate(zip(seq.images, seq.spans)):
                if k not in seq.done and end >= s + count:
                    seq.done.add(k)
                    self._unclaim(image.content_hash, chunk.seq_id, later=True)

    def _unclaim(self, content_hash: bytes, seq_id: int, later: bool = False) -> None:
        """`seq_id` no longer needs the image; its embeddings go when nobody does (`later`: at
        the next step, as this step's forward still reads them)."""
        claims = self.claims.get(content_hash)
        if claims is not None:
            claims[seq_id] -= 1
            if claims[seq_id] <= 0:
                del claims[seq_id]
        if later:
            self._released.add(content_hash)
        else:
            self._drop_if_unclaimed(content_hash)

    def _drop_if_unclaimed(self, content_hash: bytes) -> None:
        if not self.claims.get(content_hash):
            self.claims.pop(content_hash, None)
            self.cache.pop(content_hash)

    def decode_positions(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """A decode-only step's M-RoPE positions [3, n] (each chunk one generated token: index +
        delta), for the CUDA-graph buffers; None without M-RoPE."""
        return self._positions(chunks, list(range(1, len(chunks) + 1)), len(chunks)) if self.mrope else None

    def _positions(self, chunks: Sequence[ScheduledChunk], packed_end: list[int], num_rows: int) -> torch.Tensor:
        """M-RoPE positions of the packed row, [3, num_rows] (padding: 0): prompt tokens take their
        request's rotary positions, generated ones index + delta on all three axes.

        Why in whole-row tensor ops: every row first gets index + its request's delta (a running
        sum over the chunks in packed order), then only the chunks that still hold
        prompt tokens overwrite theirs with a slice of their request's precomputed table. A decode
        step (every chunk one generated token) thus costs a few tensor ops, not a loop of them."""
        out = torch.zeros(3, num_rows, dtype=torch.int64)
        seqs = [self.seqs.get(c.seq_id) for c in chunks]
        order = sorted(range(len(chunks)), key=packed_end.__getitem__)  # packed order (the row has no gaps)
        counts = [chunks[i].num_tokens for i in order]
        deltas = [0 if s is None else s.delta for s in seqs]
        # what each chunk's packed row index adds to become its position: start - first row + delta
        shift = [chunks[i].start + deltas[i] - packed_end[i] + n for i, n in zip(order, counts)]
        firsts = list(accumulate(counts, initial=0))  # [n + 1] each chunk's first packed row, then the total
        total = firsts.pop()
        # each row's shift as the running sum of the changes at chunk starts (why not repeat_interleave:
        # on the CPU it splits even 64 rows across torch's threads, which stalls on a busy machine)
        steps = torch.zeros(total, dtype=torch.int64)  # [total]
        steps[torch.tensor(firsts, dtype=torch.int64)] = torch.tensor(shift, dtype=torch.int64).diff(prepend=ZERO)
        out[:, :total] = torch.arange(total) + steps.cumsum(0)  # [total]
        for chunk, end, seq in zip(chunks, packed_end, seqs):
            if seq is None or seq.rotary is None or chunk.start >= seq.num_prompt:
                continue
            first, a = end - chunk.num_tokens, chunk.start
            p = min(a + chunk.num_tokens, seq.num_prompt)
            out[:, first : first + p - a] = seq.rotary[:, a:p]  # [3, prompt tokens of the chunk]
        return out
