"""What a step brings back to the host, planned before the forward and read in ONE device->host copy.

Why a module: on a GPU every read of a device value is a host sync, and features used to add
their own (logprobs read their values, ranks and top-K one by one, prompt logprobs again, a
prompt-only step its NaN flag). Here the engine plans, before the forward, which rows draw
(forked samples included) and which prompt tokens are scored, staging their indices and targets
in the step's one upload (`StepPlan`); after the forward everything the host needs, the sampled
ids, the NaN flag and every logprob value, rank and top-K id, is computed on the device and read
in one `Transfers.read` (`read_outputs`), and split back here (`StepOutputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchgen.engine.loop.requests import RequestState
from batchgen.engine.sampling.batch import SamplingStep
from batchgen.engine.sampling.logprobs import raw_logprobs, score
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.staging.transfers import Transfers


@dataclass
class PromptRows:
    """A step's prompt-logprob rows (the logits after the sampled ones): per chunk (its request,
    its first position, its rows), each row's target prompt token and K."""

    chunks: list[tuple[RequestState, int, int]]
    targets: list[int]
    ks: list[int]
    staged: torch.Tensor  # targets on the device [rows]


@dataclass
class StepPlan:
    """The engine's decisions before the forward about what the step's logits become."""

    sampled: list[int]  # the sampled chunks' sequences: logits rows 0 .. len - 1
    seq_ids: list[int]  # the sequences that draw a token now (a forking parent's samples too)
    rows: torch.Tensor | None  # [len(seq_ids)] the logits row each draws from; None: rows 0.. in order
    ends: list[RequestState] = field(default_factory=list)  # max_tokens 0: end after the forward, unsampled
    step: SamplingStep | None = None  # the drawing rows' sampling state (inputs staged)
    prompt: PromptRows | None = None


@dataclass
class StepOutputs:
    """The step's one read, split: ids and NaN flag, then the logprob pieces (flat lists)."""

    tokens: list[int]
    nan: bool
    logprobs: list[list] | None  # score()'s tensors for the rows that asked, as read
    prompt: list[list] | None  # score()'s tensors for the prompt rows, as read


def prompt_rows(plan_chunks: list[tuple[RequestState, int, int]], transfers: Transfers) -> PromptRows | None:
    """Targets and K of each prompt-logprob row: row j of a chunk starting at `start` predicts prompt
    token start + j + 1."""
    if not plan_chunks:
        return None
    targets: list[int] = []
    ks: list[int] = []
    for request, start, count in plan_chunks:
        targets.extend(request.parent.prompt_token_ids[start + 1 : start + 1 + count])
        ks.extend([int(request.params.prompt_logprobs or 0)] * count)
    staged = transfers.stage(torch.tensor(targets, dtype=torch.int64))
    return PromptRows(plan_chunks, targets, ks, staged)


def read_outputs(plan: StepPlan, logits: torch.Tensor, sampler: Sampler, transfers: Transfers) -> StepOutputs | None:
    """Draw, score logprobs, and read it all back in one copy; None when the step gives nothing to read."""
    sampled_rows = logits[: len(plan.sampled)]
    drawn = sampled_rows if plan.rows is None else sampled_rows.index_select(0, plan.rows)
    # the NaN check covers every row; the sampler's own check covers the rows it is given
    sees_all = plan.step is not None and plan.rows is None and len(plan.sampled) == logits.shape[0]
    nan = logits.amax().isnan() if logits.shape[0] and not sees_all else None
    head: list[torch.Tensor] = []
    logprobs: list[torch.Tensor] = []
    step = plan.step
    if step is not None:
        # why before the sampler: logprobs are of the raw distribution, whatever the sampler does
        raw = raw_logprobs(drawn, step.logprobs.index) if step.logprobs is not None else None
        if nan is None:
            ids, nan = sampler.sample_ids_and_nan(drawn, step)
        else:
            ids = sampler.sample_ids(drawn, step)
        head = [ids, nan]
        if raw is not None and step.logprobs is not None:
            index = step.logprobs.index
            logprobs = score(raw, ids if index is None else ids[index], step.logprobs.ks)
    elif nan is not None:
        head = [nan]
    if not head:
        return None
    prompt: list[torch.Tensor] = []
    if plan.prompt is not None:
        scored = raw_logprobs(logits[len(plan.sampled) :])  # [prompt rows, V]
        prompt = score(scored, plan.prompt.staged, plan.prompt.ks)
    # why one read: the NaN flag and every logprob come back with the sampled ids, one host sync per step
    values = transfers.read("sampled_ids" if step is not None else "nan_flag", *head, *logprobs, *prompt)
    tokens: list[int] = values[0] if step is not None else []  # type: ignore[assignment]
    rest = values[len(head) :]
    return StepOutputs(
        tokens=tokens,
        nan=bool(values[len(head) - 1][0]),
        logprobs=rest[: len(logprobs)] if logprobs else None,
        prompt=rest[len(logprobs) :] if prompt else None,
    )
