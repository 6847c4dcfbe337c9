"""Logits processing between the raw logits and temperature: penalties, biases, bans, grammars.

The sampler makes one call, `LogitsFeatures.apply(logits, picked)`, for the step's rows that use a
feature (the sampling batch knows which; no call at all when none does). Order per row, as in vLLM:
allowed_token_ids -> bad_words -> logit_bias -> repetition_penalty -> presence/frequency ->
structured-output mask. Semantics:
  * repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor, so greedy output equals
    `generate(repetition_penalty=...)`): over every token of prompt + output, a positive logit is
    divided by the penalty and a negative one multiplied by it, once per distinct token;
  * presence/frequency (OpenAI, vLLM): over generated tokens only,
    logit -= frequency * count + presence * (count > 0);
  * logit_bias: added to the token's logit; allowed_token_ids: every other token gets -inf;
  * bad_words (transformers' bad_words_ids, vLLM's bad_words): each word is tokenized as written
    and with a leading space; a word's last token is banned when the tokens before it end the
    sequence (prompt + output), so a one-token word is never generated.
Per-row state (seen tokens, output counts, the tail bad words look at, the grammar matcher) is a
FeatureRow, held by the runner's sampling batch (sampling/batch): made from the prompt when the
sequence is new (`row`), advanced by each sampled token (`accept`). Preemption cannot disturb it:
a preempted sequence keeps its tokens. `check` refuses a request up front (ids outside the
vocabulary, a grammar that does not compile), so making its row later cannot fail.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.sampling.structured import GrammarCache, StructuredError, mask_rows

logger = logging.getLogger(__name__)


@dataclass
class FeatureRow:
    """One sequence's logits-processing state."""

    seq_id: int
    params: SamplingParams
    bad_words: list[tuple[int, ...]]
    matcher: Any = None  # xgrammar.GrammarMatcher for a structured row
    seen: torch.Tensor | None = None  # [V] bool: token occurs in prompt + output (repetition)
    counts: torch.Tensor | None = None  # [V] float32: occurrences in the output (presence/frequency)
    tail: list[int] | None = None  # prompt + output tokens, kept only when bad words look back
    terminated: bool = False  # the grammar has accepted a complete output


class LogitsFeatures:
    """Per-request logits processing for one engine: tokenizer-aware, vectorized over a step's rows."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = GrammarCache(tokenizer, vocab_size, stop_token_ids)

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
        self, seq_id: int, prompt_token_ids: Sequence[int], params: SamplingParams, device: torch.device
    ) -> FeatureRow:
        """A new sequence's state, from its prompt (its request passed `check`)."""
        row = FeatureRow(seq_id, params, bad_word_token_ids(self.tokenizer, params.bad_words))
        if params.structured is not None:
            row.matcher = self.grammars.matcher(params.structured)
        if params.repetition_penalty != 1.0:
            row.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            if prompt_token_ids:
                row.seen[torch.tensor(list(prompt_token_ids), device=device)] = True
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            row.counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=device)
        if any(len(word) > 1 for word in row.bad_words):
            row.tail = list(prompt_token_ids)
        return row

    def apply(self, logits: torch.Tensor, picked: list[tuple[int, FeatureRow]]) -> torch.Tensor:
        """Processed logits (a new tensor); `picked`: (row of `logits`, its state) of every row with features."""
        if not picked:
            return logits
        index = torch.tensor([i for i, _ in picked], device=logits.device)
        sub = logits[index].float()  # [m, V] a copy: the caller's logits stay intact
        rows = [row for _, row in picked]
        self._mask_and_bias(sub, rows)
        _penalize(sub, rows)
        constrained = [j for j, row in enumerate(rows) if row.matcher is not None and not row.terminated]
        if constrained:
            mask_rows(sub, constrained, [rows[j].matcher for j in constrained])
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()  # .float() copies already
        out[index] = sub
        return out

    def accept(self, picked: list[tuple[int, FeatureRow]], tokens: list[int]) -> None:
        """After the draw: each row's state takes its token (`tokens[i]` for row i of the step)."""
        for i, row in picked:
            token = tokens[i]
            if row.seen is not None:
                row.seen[token] = True
            if row.counts is not None:
                row.counts[token] += 1.0
            if row.tail is not None:
                row.tail.append(token)
            if row.matcher is None or row.terminated:
                continue
            if not row.matcher.accept_token(token):
                logger.warning("request %d: the grammar refused token %d; ending it", row.seq_id, token)
                row.terminated = True
                continue
            row.terminated = bool(row.matcher.is_terminated())

    # ------------------------------------------------------------------ helpers

    def _mask_and_bias(self, sub: torch.Tensor, rows: list[FeatureRow]) -> None:
        """allowed_token_ids, bad_words (-inf) and logit_bias (added), each in one indexed write."""
        allowed = [(j, row.params.allowed_token_ids) for j, row in enumerate(rows) if row.params.allowed_token_ids]
        if allowed:
            keep = torch.zeros((len(allowed), sub.shape[1]), dtype=torch.bool, device=sub.device)
            for k, (_, ids) in enumerate(allowed):
                keep[k, torch.tensor(ids, device=sub.device)] = True
            index = torch.tensor([j for j, _ in allowed], device=sub.device)
            sub[index] = sub[index].masked_fill(~keep, float("-inf"))
        banned: list[tuple[int, int]] = []
        for j, row in enumerate(rows):
            for word in row.bad_words:
                prefix = word[:-1]
                if not prefix or (row.tail is not None and tuple(row.tail[-len(prefix) :]) == prefix):
                    banned.append((j, word[-1]))
        if banned:
            r, c = zip(*banned)
            sub[torch.tensor(r, device=sub.device), torch.tensor(c, device=sub.device)] = float("-inf")
        biases = [(j, t, b) for j, row in enumerate(rows) for t, b in (row.params.logit_bias or {}).items()]
        if biases:
            r, c, v = zip(*biases)
            at = (torch.tensor(r, device=sub.device), torch.tensor(c, device=sub.device))
            sub.index_put_(at, torch.tensor(v, dtype=sub.dtype, device=sub.device), accumulate=True)


def bad_word_token_ids(tokenizer: Any, words: list[str]) -> list[tuple[int, ...]]:
    """Token ids of each word as written and after a space (vLLM's two spellings), deduplicated."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
            if ids:
                out[ids] = None
    return list(out)


def _penalize(sub: torch.Tensor, rows: list[FeatureRow]) -> None:
    """Repetition (transformers) then presence/frequency (OpenAI), vectorized over the rows that use them."""
    rep = [j for j, row in enumerate(rows) if row.seen is not None]
    if rep:
        index = torch.tensor(rep, device=sub.device)
        penalty = torch.tensor([rows[j].params.repetition_penalty for j in rep], device=sub.device)[:, None]
        seen = torch.stack([rows[j].seen for j in rep])  # type: ignore[misc]  # [k, V]
        x = sub[index]
        sub[index] = torch.where(seen, torch.where(x < 0, x * penalty, x / penalty), x)
    pf = [j for j, row in enumerate(rows) if row.counts is not None]
    if pf:
        index = torch.tensor(pf, device=sub.device)
        presence = torch.tensor([rows[j].params.presence_penalty for j in pf], device=sub.device)[:, None]
        frequency = torch.tensor([rows[j].params.frequency_penalty for j in pf], device=sub.device)[:, None]
        counts = torch.stack([rows[j].counts for j in pf])  # type: ignore[misc]  # [k, V]
        sub[index] = sub[index] - frequency * counts - presence * (counts > 0).float()
