"""A step's draw, planned before the forward and read back in ONE device->host copy.

Why: on a GPU every read of a device value is a sync. `prepare_draw` stages what the draw needs
before the step's one upload; after the forward `finish_draw` computes on the device all the host
needs (ids, NaN flag, logprobs), reads it in one `Transfers.read` and returns the ModelRunnerOutput.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from batchgen.engine.core.runner_output import EMPTY_OUTPUT, LogprobLists, ModelRunnerOutput
from batchgen.engine.core.scheduler_output import BatchUpdate, NewSequence, ScheduledBatch
from batchgen.engine.sampling.batch import SamplingBatch, SamplingStep
from batchgen.engine.sampling.logprobs import raw_logprobs, score
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.staging.transfers import Transfers


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
    if step is None:
        return ModelRunnerOutput(nan=nan_flag, prompt_logprobs=_prompt_lists(draw.prompt, rest))
    tokens: list[int] = values[0]  # type: ignore[assignment]
    batch = step.batch
    batch.accept(step, tokens)  # min_tokens counts, bad-word tails and grammar matchers advance
    lists = None
    if step.logprobs is not None and logprobs:
        asked = step.logprobs.rows
        lists = LogprobLists(asked, step.logprobs.ks, [tokens[i] for i in asked], rest[: len(logprobs)])
    done = frozenset(s for s in step.seq_ids if batch.terminated(s)) if step.grammars else frozenset()
    return ModelRunnerOutput(tokens, nan_flag, lists, _prompt_lists(draw.prompt, rest[len(logprobs) :]), done)


def _prompt_lists(prompt: tuple[LogprobLists, torch.Tensor] | None, read: list) -> LogprobLists | None:
    return None if prompt is None else replace(prompt[0], read=read)


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
