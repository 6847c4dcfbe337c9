"""Logits processing between the raw logits and temperature: penalties, biases, bans, grammars.

One call per step, `LogitsFeatures.apply(logits, plan)`, for the rows that use a feature; order
and semantics as README's "Penalties, biases, bad words" states them (vLLM's order).
Per-row host state is a FeatureRow (made by `row`, advanced by `accept`); the penalties' token
history lives on the device (PenaltyTables: rows own a slot of two [slots, V] tables, seen in
prompt + output and output counts; a step gathers its slots with one staged index and counts the
sampled ids in one indexed write on the device, so no host value is needed). `check` refuses a bad
request up front, so making its row later cannot fail. A step's inputs are device tensors in its
staged upload (FeaturePlan): what depends only on the step's rows is staged once and kept while
they are the same (`plan_features`); what depends on the last tokens (bans, grammar bitmasks) is
staged each step before the forward (`stage_step_inputs`). No blocking copy mid-sampler.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.sampling.structured import GrammarCache, StructuredError, apply_bitmask, fill_bitmask
from batchgen.engine.staging.transfers import Transfers, put_scalar

logger = logging.getLogger(__name__)


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


class LogitsFeatures:
    """Per-request logits processing for one engine: tokenizer-aware, vectorized over a step's rows."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = GrammarCache(tokenizer, vocab_size, stop_token_ids)
        self.tables: PenaltyTables | None = None  # made with the first penalized row, on its device

    def check(self, seq_id: int, params: SamplingParams) -> str | None:
        """Why a request's features cannot be served (its grammar is compiled now, once), or None."""
        ids = [*(params.logit_bias or {}), *(params.allowed_token_ids or [])]
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            where = f"logit_bias/allowed_token_ids are outside the vocabulary [0, {self.vocab_size})"
            return f"request {seq_id}: token ids {bad[:5]} in {where}"
        if params.structured is not None:
            try:
                self.grammars.compiled(params.structured)
            except StructuredError as exc:
                return f"request {seq_id}: invalid_structured: {exc}"
        return None

    def row(
        self,
        seq_id: int,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        device: torch.device,
        staging: Transfers,
    ) -> FeatureRow:
        """A new sequence's state, from its prompt (its request passed `check`); a penalized row's
        device history is filled from the prompt after this step's upload."""
        row = FeatureRow(seq_id, params, bad_word_token_ids(self.tokenizer, params.bad_words))
        if params.structured is not None:
            row.matcher = self.grammars.matcher(params.structured)
        if params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            if self.tables is None:
                self.tables = PenaltyTables(self.vocab_size, device)
            row.slot = self.tables.take(prompt_token_ids, staging)
        if any(len(word) > 1 for word in row.bad_words):
            row.tail = list(prompt_token_ids)
        return row

    def release(self, row: FeatureRow) -> None:
        """A finished row's device history slot is free again."""
        if row.slot is not None and self.tables is not None:
            self.tables.release(row.slot)
            row.slot = None

    def clear(self) -> None:
        """Every row is gone (an aborted generate)."""
        if self.tables is not None:
            self.tables.clear()

    def apply(self, logits: torch.Tensor, plan: FeaturePlan) -> torch.Tensor:
        """Processed logits (a new tensor); the plan names the rows with features and holds their inputs."""
        sub = logits[plan.index].float()  # [m, V] a copy: the caller's logits stay intact
        _mask_and_bias(sub, plan)
        if self.tables is not None:
            _penalize(sub, plan, self.tables)
        if plan.grammar is not None:
            rows, bitmask = plan.grammar
            apply_bitmask(sub, rows, bitmask.to(torch.int32))
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()  # .float() copies already
        out[plan.index] = sub
        return out

    def count(self, plan: FeaturePlan, ids: torch.Tensor) -> None:
        """On the device, after the draw: penalized rows' histories take their sampled ids ([n] step rows)."""
        if plan.counted is not None and self.tables is not None:
            rows, slots = plan.counted
            self.tables.count(slots, ids[rows])

    def accept(self, picked: list[tuple[int, FeatureRow]], tokens: list[int]) -> None:
        """After the read: each row's host state takes its token (`tokens[i]` for row i of the step)."""
        for i, row in picked:
            token = tokens[i]
            if row.tail is not None:
                row.tail.append(token)
            if row.matcher is None or row.terminated:
                continue
            if not row.matcher.accept_token(token):
                logger.warning("request %d: the grammar refused token %d; ending it", row.seq_id, token)
                row.terminated = True
                continue
            row.terminated = bool(row.matcher.is_terminated())


def bad_word_token_ids(tokenizer: Any, words: list[str]) -> list[tuple[int, ...]]:
    """Token ids of each word as written and after a space (vLLM's two spellings), deduplicated."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids:
                out[ids] = None
    return list(out)


def _mask_and_bias(sub: torch.Tensor, plan: FeaturePlan) -> None:
    """allowed_token_ids, bad_words (-inf) and logit_bias (added), each in one indexed write."""
    if plan.allowed is not None:
        rows, pairs = plan.allowed  # [a], [2, n]: (k-th allowed row, token)
        keep = torch.zeros((rows.shape[0], sub.shape[1]), dtype=torch.bool, device=sub.device)
        put_scalar(keep, (pairs[0], pairs[1]), True)
        sub[rows] = sub[rows].masked_fill(~keep, float("-inf"))
    if plan.bans is not None:
        put_scalar(sub, (plan.bans[0], plan.bans[1]), float("-inf"))
    if plan.bias is not None:
        pairs, values = plan.bias  # why scatter_add_: one kernel on the flat view (PenaltyTables.count)
        sub.view(-1).scatter_add_(0, pairs[0] * sub.shape[1] + pairs[1], values.to(sub.dtype))


def _penalize(sub: torch.Tensor, plan: FeaturePlan, tables: PenaltyTables) -> None:
    """Repetition (transformers) then presence/frequency (OpenAI), vectorized over the rows that use them."""
    if plan.repetition is not None:
        rows, penalty, slots = plan.repetition  # [k], [k], [k]
        seen = tables.seen[slots]  # [k, V]
        x = sub[rows]
        p = penalty[:, None]
        sub[rows] = torch.where(seen, torch.where(x < 0, x * p, x / p), x)
    if plan.presence_frequency is not None:
        rows, presence, frequency, slots = plan.presence_frequency
        counts = tables.counts[slots]  # [k, V]
        sub[rows] = sub[rows] - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()


class PenaltyTables:
    """Slots of seen [slots, V] bool (prompt + output) and counts [slots, V] float32 (output), on the device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self.counts = torch.zeros((0, vocab_size), dtype=torch.float32, device=device)
        self._free: list[int] = []  # released slots, lowest first
        self._used = 0  # slots ever handed out (the tables' rows in use or free)

    def take(self, prompt_token_ids: Sequence[int], staging: Transfers) -> int:
        """A slot for a new row: zeroed, its prompt's tokens marked seen after this step's upload."""
        slot = heapq.heappop(self._free) if self._free else self._grow()
        prompt = staging.stage(torch.tensor(list(prompt_token_ids), dtype=torch.int64))  # [P]

        def fill() -> None:
            self.seen[slot].fill_(False)
            self.counts[slot].fill_(0.0)
            put_scalar(self.seen[slot], (prompt,), True)  # [V] view of the slot

        staging.on_upload(fill)
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def clear(self) -> None:
        self._free, self._used = [], 0

    def count(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each slot takes its row's sampled token (slots, tokens: [k] on the device).

        Why put_scalar and scatter_add_: `seen[slots, tokens] = True` copied the Python True to the
        device with a blocking copy, a second sync in every decode step (the H200 run's profiler);
        the counts take one scatter_add_ on the flat table (bounds checked on the device)."""
        put_scalar(self.seen, (slots, tokens), True)
        flat = slots * self.vocab_size + tokens  # [k]
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(tokens, dtype=torch.float32))

    def _grow(self) -> int:
        slot = self._used
        self._used += 1
        if slot == self.seen.shape[0]:  # why doubling: a device allocation and copy, rarely
            size = max(8, 2 * slot)
            seen = torch.zeros((size, self.vocab_size), dtype=torch.bool, device=self.device)
            counts = torch.zeros((size, self.vocab_size), dtype=torch.float32, device=self.device)
            seen[:slot] = self.seen
            counts[:slot] = self.counts
            self.seen, self.counts = seen, counts
        return slot
