"""Sampler: one engine step's logits -> one next token id per sequence, without reading anything back.

Greedy rows take the exact argmax of the raw logits (as transformers' greedy `generate`). Others
go through temperature, top-k, top-p, min-p and the exponential race (argmax of p / q, q ~ Exp(1):
an exact draw); a seeded row draws its q from its own generator, so its tokens do not depend on
its batch. Per-row inputs come from a SamplingStep (sampling/batch).

A step's draw is planned before the forward and read back in ONE device->host copy (why: on a GPU
every read of a device value is a sync): `prepare_draw` stages what the draw needs before the
step's one upload; after the forward `finish_draw` computes on the device all the host needs (ids,
NaN flag, logprobs), reads it in one `Transfers.read` and returns the ModelRunnerOutput.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from batchgen.engine.api.platform import GreedyIds
from batchgen.engine.core.runner_output import EMPTY_OUTPUT, LogprobLists, ModelRunnerOutput
from batchgen.engine.core.scheduler_output import BatchUpdate, NewSequence, ScheduledBatch
from batchgen.engine.sampling.batch import SamplingBatch, SamplingStep
from batchgen.engine.sampling.logprobs import raw_logprobs, score
from batchgen.engine.sampling.penalties import LogitsFeatures, stage_step_inputs
from batchgen.engine.staging.transfers import Transfers, put_scalar

# Tokens ranked before top-p falls back to a full sort; nuclei of real models are far smaller.
NUCLEUS_WINDOW = 1024


class Sampler:
    """Turns `[num_seqs, vocab]` logits into token ids. `eos_token_ids` are masked (with each
    request's `stop_token_ids`) below `min_tokens`; `seed` seeds the unseeded rows' shared generator."""

    def __init__(
        self,
        eos_token_ids: Iterable[int],
        features: LogitsFeatures,
        seed: int | None = None,
        fast_greedy: GreedyIds | None = None,
    ) -> None:
        """`features`: sampling/penalties (their rows live in the SamplingBatch); `fast_greedy`: the
        device's own greedy pass (greedy_ids)."""
        self.eos_token_ids: frozenset[int] = frozenset(int(t) for t in eos_token_ids)
        self.fast_greedy = fast_greedy
        self._seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self.features = features

    def prepare(self, step: SamplingStep) -> None:
        """Before the step's upload: stage its min_tokens mask, bans and grammar bitmasks."""
        staging, vocab = step.batch.transfers, self.features.vocab_size
        step.banned = None
        if step.min_tokens:
            rows: list[int] = []
            cols: list[int] = []
            for i, stop_ids in step.batch.short_rows(step):
                ids = [t for t in self.eos_token_ids.union(stop_ids) if t < vocab]
                rows.extend([i] * len(ids))
                cols.extend(ids)
            if rows:
                step.banned = staging.stage(torch.tensor([rows, cols]))  # [2, n]
        if step.features is not None:
            stage_step_inputs(step.features, staging, vocab)

    def sample(self, logits: torch.Tensor, step: SamplingStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token id per row of `logits` [n, V] -> (ids [n] int64 on the device, a 0-d bool set
        when any entry of the raw logits is NaN, or None). The flag is free when greedy rows took
        every row's maximum of the raw logits; masked logits could hide a NaN, so then None: the
        caller reads them again."""
        if logits.dim() != 2 or logits.shape[0] != len(step.seq_ids):
            raise ValueError(f"logits must be [len(seqs)={len(step.seq_ids)}, vocab], got {tuple(logits.shape)}")
        raw = logits
        if step.banned is not None:
            # why a copy: the caller's logits stay intact (a logprobs feature may read them later)
            logits = logits.clone()
            put_scalar(logits, (step.banned[0], step.banned[1]), float("-inf"))
        if step.features is not None:
            logits = self.features.apply(logits, step.features)
        ids, nan = self._draw(logits, step)
        if step.features is not None:
            self.features.count(step.features, ids)  # penalty histories take the ids on the device
        return ids, nan if logits is raw else None

    def _draw(self, logits: torch.Tensor, step: SamplingStep) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (ids [num_seqs], the NaN flag of `logits` when greedy rows took every row's maximum, else None)."""
        if len(step.sample_rows) == len(step.seq_ids):
            return self._sample(logits, step), None
        tokens, nan = greedy_ids(logits, self.fast_greedy)  # [num_seqs] greedy for every row; sampled rows overwritten
        if step.sample_rows:
            rows = step.sample_index
            assert rows is not None  # set whenever only some rows sample
            tokens[rows] = self._sample(logits[rows], step)
        return tokens, nan

    def _sample(self, logits: torch.Tensor, step: SamplingStep) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and the exponential race on the sampled rows."""
        assert step.params is not None  # set whenever some row samples
        temperature, top_k, top_p, min_p = step.params.unbind(dim=1)  # each [n]
        probs = (logits.float() / temperature[:, None]).softmax(dim=-1)  # [n, V]
        max_k = step.max_k(logits.shape[-1])
        if max_k or step.need_p:
            probs = _filter_top_k_top_p(probs, top_k.long(), top_p, max_k, step.need_p, step.may_read)
        if step.need_min_p:
            # min-p is relative to the most likely token, so renormalising after top-k/p is moot
            floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [n, 1]
            probs = probs.masked_fill_(probs < floor, 0.0)
        q = self._exponentials(probs.shape, step, probs.device)  # [n, V]
        return probs.div_(q).argmax(dim=-1)  # [n]

    def _exponentials(self, shape: torch.Size, step: SamplingStep, device: torch.device) -> torch.Tensor:
        """Exp(1) noise: seeded rows from their own generator, the rest in one shared draw."""
        u = torch.empty(shape, dtype=torch.float32, device=device)  # [n, V] uniform in [0, 1)
        if not step.seeded:
            u.uniform_(generator=self._shared_generator(device))
        else:
            rows = step.unseeded_index
            if rows is not None:
                noise = torch.empty((rows.shape[0], shape[1]), dtype=torch.float32, device=device)
                u[rows] = noise.uniform_(generator=self._shared_generator(device))
            for i, generator in zip(step.seeded, step.generators):
                # why always V values: the generator's position must not depend on the batch; why a
                # generator per row: on the device it draws without the host (no sync), in order
                u[i].uniform_(generator=generator)
        # why -log(u) and not exponential_: 3x cheaper on CPU; u = 0 gives q = inf, a score of 0
        return u.log_().neg_()

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._seed)
            self._shared[device] = generator
        return generator


def greedy_ids(logits: torch.Tensor, fast: GreedyIds | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] -> (each row's first index of its maximum [n] int64, a 0-d bool: some entry is NaN).
    `fast`: the device's own pass, where it answers; why max(), not argmax(): ~3x faster on CPU."""
    if fast is not None and (found := fast(logits)) is not None:
        return found
    row_max, ids = logits.max(dim=-1)
    return ids, row_max.amax().isnan()


def _filter_top_k_top_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int, need_p: bool, may_read: bool
) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k, then outside its nucleus of the top-k.

    Order as in transformers. Both keep a prefix of the descending order, so the best `width` tokens
    (one topk, cheaper than a sort on CPU) decide, unless a nucleus reaches past them (checked only
    where a read is free, `may_read`; elsewhere top-p sorts fully). probs [n, V]; top_k [n] (V when
    off); top_p [n] (1.0 when off); max_k: the largest enabled k (0: none).
    """
    vocab = probs.shape[-1]
    width = max_k
    if need_p:
        width = min(vocab, max(max_k, NUCLEUS_WINDOW)) if may_read else vocab
    keep = _keep_in_window(probs, top_k, top_p, width, need_p)
    if keep is None:
        keep = _keep_in_window(probs, top_k, top_p, vocab, need_p)
    return probs.masked_fill_(~keep, 0.0)  # type: ignore[operator]


def _keep_in_window(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, width: int, need_p: bool
) -> torch.Tensor | None:
    """[n, V] mask of kept tokens, decided on the best `width`; None when that is too few."""
    vocab = probs.shape[-1]
    if width < vocab:
        ranked, order = probs.topk(width, dim=-1)  # [n, w] each, descending
    else:  # why stable: equal probabilities keep vocabulary order, the same in any batch
        ranked, order = probs.sort(dim=-1, descending=True, stable=True)  # [n, V] each
    positions = torch.arange(width, device=probs.device)  # [w]
    drop = positions[None, :] >= top_k[:, None]  # [n, w] beyond the row's k
    no_k = top_k >= vocab  # [n]
    uses_p = top_p < 1.0  # [n]
    if need_p:
        kept = ranked.masked_fill(drop, 0.0)  # [n, w]
        cumulative = kept.cumsum(dim=-1)  # [n, w]
        # the nucleus is a share of the top-k's mass; without top-k, of the whole row (1)
        total = torch.where(no_k, torch.ones_like(top_p), cumulative[:, -1])  # [n]
        limit = top_p * total  # [n]
        if width < vocab and bool((no_k & uses_p & (cumulative[:, -1] < limit)).any()):
            return None  # some nucleus extends past the window
        # why the uses_p guard: a float cumsum can reach 1.0 before the tail and cut it
        drop |= ((cumulative - kept) >= limit[:, None]) & uses_p[:, None]
    # rows without top-k and top-p keep what lies outside the window; all others drop it
    keep = (no_k & ~uses_p)[:, None].expand(-1, vocab).clone()  # [n, V]
    return keep.scatter_(1, order, ~drop)


@dataclass
class StepDraw:
    """What was staged before the upload for the step's draw and scoring."""

    step: SamplingStep | None  # the drawing rows' sampling state; None: nothing draws
    rows: torch.Tensor | None  # [len(draws)] the logits row each draws from; None: rows 0.. in order
    # the prompt-logprob rows (the logits after the sampled ones), still unread, and their targets
    # on the device [rows]
    prompt: tuple[LogprobLists, torch.Tensor] | None


def prepare_draw(batch: ScheduledBatch, rows: SamplingBatch, sampler: Sampler, transfers: Transfers) -> StepDraw:
    """Stage the draw's inputs (the step's diff must be applied to `rows` already)."""
    step = None
    if batch.draws:
        step = rows.step(batch.draws)  # kept while the batch is unchanged
        sampler.prepare(step)
    staged = None if batch.draw_rows is None else transfers.stage(torch.tensor(batch.draw_rows, dtype=torch.int64))
    prompt = _prompt_rows(batch, rows)
    if prompt is None:
        return StepDraw(step, staged, None)
    return StepDraw(step, staged, (prompt, transfers.stage(torch.tensor(prompt.targets, dtype=torch.int64))))


def _prompt_rows(batch: ScheduledBatch, rows: SamplingBatch) -> LogprobLists | None:
    """Targets and K of each prompt-logprob row: row j of a chunk starting at `start` predicts prompt
    token start + j + 1."""
    chunks = [(c.seq_id, c.start, c.prompt_logits) for c in batch.chunks if c.prompt_logits]
    if not chunks:
        return None
    targets: list[int] = []
    ks: list[int] = []
    for seq_id, start, count in chunks:
        prompt, k = rows.prompt(seq_id)
        targets.extend(prompt[start + 1 : start + 1 + count])
        ks.extend([k] * count)
    return LogprobLists(list(range(len(targets))), ks, targets, [], chunks)


def finish_draw(
    draw: StepDraw, logits: torch.Tensor, num_sampled: int, sampler: Sampler, transfers: Transfers
) -> ModelRunnerOutput:
    """Draw, score logprobs and read it all back in one copy. `logits`: [num_sampled + prompt rows, V]."""
    step = draw.step
    sampled_rows = logits[:num_sampled]
    drawn = sampled_rows if draw.rows is None else sampled_rows.index_select(0, draw.rows)
    # the NaN check covers every row; the sampler's own check covers the rows it is given
    sees_all = step is not None and draw.rows is None and num_sampled == logits.shape[0]
    nan = logits.amax().isnan() if logits.shape[0] and not sees_all else None
    head: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    if step is not None:
        # why before the sampler: logprobs are of the raw distribution, whatever the sampler does
        raw = raw_logprobs(drawn, step.logprobs.index) if step.logprobs is not None else None
        ids, found = sampler.sample(drawn, step)
        if nan is None:  # why amax: it propagates NaN, ~10x faster than isnan().any() on CPU
            nan = found if found is not None else drawn.amax().isnan()
        head = [ids, nan]
        if raw is not None and step.logprobs is not None:
            index = step.logprobs.index
            logprobs = score(raw, ids if index is None else ids[index], step.logprobs.ks)
    elif nan is not None:
        head = [nan]
    if not head:
        return EMPTY_OUTPUT
    prompt: list[torch.Tensor] = []
    if draw.prompt is not None:
        scored = raw_logprobs(logits[num_sampled:])  # [prompt rows, V]
        prompt = score(scored, draw.prompt[1], draw.prompt[0].ks)
    # why one read: the NaN flag and every logprob come back with the drawn ids, one host sync per step
    values = transfers.read("sampled_ids" if step is not None else "nan_flag", *head, *logprobs, *prompt)
    rest = values[len(head) :]
    nan_flag = bool(values[len(head) - 1][0])
    prompt_lists = None if draw.prompt is None else replace(draw.prompt[0], read=rest[len(logprobs) :])
    if step is None:
        return ModelRunnerOutput(nan=nan_flag, prompt_logprobs=prompt_lists)
    tokens: list[int] = values[0]  # type: ignore[assignment]
    batch = step.batch
    batch.accept(step, tokens)  # min_tokens counts, bad-word tails and grammar matchers advance
    lists = None
    if step.logprobs is not None and logprobs:
        asked = step.logprobs.rows
        lists = LogprobLists(asked, step.logprobs.ks, [tokens[i] for i in asked], rest[: len(logprobs)])
    done = frozenset(s for s in step.seq_ids if batch.terminated(s)) if step.grammars else frozenset()
    return ModelRunnerOutput(tokens, nan_flag, lists, prompt_lists, done)


def draw_now(
    sampler: Sampler, rows: SamplingBatch, logits: torch.Tensor, seq_ids: list[int], new: Iterable[NewSequence] = ()
) -> list[int]:
    """One draw outside an engine step (the hf backend's seeded rows, tests): a step's draw with no
    chunks, by the same path (staged, uploaded, drawn, read once); `logits` row i is `seq_ids[i]`'s,
    and `new` sequences get their rows first, as a step's diff. `logits` is not modified."""
    transfers = rows.transfers
    transfers.begin_step()
    rows.apply(BatchUpdate(new=tuple(new)))
    draw = prepare_draw(ScheduledBatch(draws=tuple(seq_ids)), rows, sampler, transfers)
    transfers.upload()
    return finish_draw(draw, logits, len(seq_ids), sampler, transfers).sampled
