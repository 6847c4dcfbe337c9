"""FeaturePlan: a step's logits-feature inputs as device tensors, all sent in the step's staged upload.

What depends only on the step's rows is staged once and kept while they are the same
(`plan_features`); what depends on the last tokens (bans, grammar bitmasks) is staged each step
before the forward (`stage_step_inputs`). No blocking copy mid-sampler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.sampling.structured import fill_bitmask
from batchgen.engine.staging.transfers import Transfers


@dataclass
class FeatureRow:
    """One sequence's logits-processing state on the host."""

    seq_id: int
    params: SamplingParams
    bad_words: list[tuple[int, ...]]
    matcher: Any = None  # xgrammar.GrammarMatcher for a structured row
    slot: int | None = None  # its PenaltyTables slot (repetition, presence or frequency)
    tail: list[int] | None = None  # prompt + output tokens, kept only when bad words look back
    terminated: bool = False  # the grammar has accepted a complete output


@dataclass
class FeaturePlan:
    """The device side of a step's feature rows. "Position": a row of `logits[index]`, in `picked` order."""

    picked: list[tuple[int, FeatureRow]]  # (step row, state) of every row with a feature
    index: torch.Tensor  # [m] their step rows
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # positions [a]; (k-th of them, allowed token) [2, n]
    bias: tuple[torch.Tensor, torch.Tensor] | None  # (position, token) [2, b]; bias [b]
    repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # positions, penalties, slots: [r] each
    presence_frequency: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # [f] each
    counted: tuple[torch.Tensor, torch.Tensor] | None  # step rows, slots [c]: where sampled ids are counted
    constrained: list[int]  # positions with a grammar
    # this step's own inputs (stage_step_inputs)
    bans: torch.Tensor | None = None  # (position, token) [2, n]: bad words' last tokens banned now
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None  # positions [k]; bitmask [k, ceil(V / 32)]


def plan_features(picked: list[tuple[int, FeatureRow]], staging: Transfers) -> FeaturePlan:
    """The kept part of the plan: everything that depends only on which rows the step has."""

    def kept(values: list[Any], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return staging.stage(torch.tensor(values, dtype=dtype), keep=True)

    rows = [row for _, row in picked]
    allowed = [(j, row.params.allowed_token_ids) for j, row in enumerate(rows) if row.params.allowed_token_ids]
    allowed_in = None
    if allowed:
        pairs = [(k, t) for k, (_, ids) in enumerate(allowed) for t in ids]
        allowed_in = (kept([j for j, _ in allowed]), kept(list(zip(*pairs))))
    biases = [(j, t, b) for j, row in enumerate(rows) for t, b in (row.params.logit_bias or {}).items()]
    bias = None
    if biases:
        r, c, v = zip(*biases)
        bias = (kept([r, c]), kept(list(v), torch.float32))
    rep = [j for j, row in enumerate(rows) if row.slot is not None and row.params.repetition_penalty != 1.0]
    repetition = None
    if rep:
        penalties = [rows[j].params.repetition_penalty for j in rep]
        repetition = (kept(rep), kept(penalties, torch.float32), kept([rows[j].slot for j in rep]))
    pf = [j for j, row in enumerate(rows) if row.slot is not None and _uses_pf(row.params)]
    presence_frequency = None
    if pf:
        presence = kept([rows[j].params.presence_penalty for j in pf], torch.float32)
        frequency = kept([rows[j].params.frequency_penalty for j in pf], torch.float32)
        presence_frequency = (kept(pf), presence, frequency, kept([rows[j].slot for j in pf]))
    slotted = [(i, row.slot) for i, row in picked if row.slot is not None]
    counted = (kept([i for i, _ in slotted]), kept([s for _, s in slotted])) if slotted else None
    return FeaturePlan(
        picked=picked,
        index=kept([i for i, _ in picked]),
        allowed=allowed_in,
        bias=bias,
        repetition=repetition,
        presence_frequency=presence_frequency,
        counted=counted,
        constrained=[j for j, row in enumerate(rows) if row.matcher is not None],
    )


def stage_step_inputs(plan: FeaturePlan, staging: Transfers, vocab_size: int) -> None:
    """This step's bans and grammar bitmasks, from the host state after the last step's tokens."""
    rows = [row for _, row in plan.picked]
    banned: list[tuple[int, int]] = []
    for j, row in enumerate(rows):
        for word in row.bad_words:
            prefix = word[:-1]
            if not prefix or (row.tail is not None and tuple(row.tail[-len(prefix) :]) == prefix):
                banned.append((j, word[-1]))
    plan.bans = staging.stage(torch.tensor(list(zip(*banned)))) if banned else None  # [2, n]
    live = [j for j in plan.constrained if not rows[j].terminated]
    plan.grammar = None
    if live:
        bitmask = fill_bitmask([rows[j].matcher for j in live], vocab_size)  # [k, W] int32 on the host
        plan.grammar = (staging.stage(torch.tensor(live)), staging.stage(bitmask))


def _uses_pf(params: SamplingParams) -> bool:
    return params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
