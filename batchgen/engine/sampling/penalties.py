"""Logits processing between the raw logits and temperature: penalties, biases, bans, grammars.

The sampler makes one call, `LogitsFeatures.apply(logits, seqs)`, and it costs nothing when no
row of the step uses a feature (one dict lookup per row). Order per row, as in vLLM:
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
Per-row state (token counts, seen tokens, the grammar matcher) lives here, keyed by seq_id, and
is folded forward from `seq.token_ids` each step, so preemption and recomputation are harmless.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.sequence import Sequence
from batchgen.engine.sampling.structured import GrammarCache, StructuredError, mask_rows

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    params: SamplingParams
    bad_words: list[tuple[int, ...]]
    matcher: Any = None  # xgrammar.GrammarMatcher for a structured row
    seen: torch.Tensor | None = None  # [V] bool: token occurs in prompt + output (repetition)
    counts: torch.Tensor | None = None  # [V] float32: occurrences in the output (presence/frequency)
    folded: int = 0  # tokens of seq.token_ids already in seen/counts
    terminated: bool = False  # the grammar has accepted a complete output


class LogitsFeatures:
    """Per-request logits processing for one engine: tokenizer-aware, vectorized over a step's rows."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.grammars = GrammarCache(tokenizer, vocab_size, stop_token_ids)
        self._rows: dict[int, _Row] = {}

    @property
    def num_active(self) -> int:
        return len(self._rows)

    def add(self, seq: Sequence) -> str | None:
        """Register a request that uses a feature; returns why it cannot be served, or None."""
        p = seq.params
        if not p.uses_logits_features:
            return None
        ids = [*(p.logit_bias or {}), *(p.allowed_token_ids or [])]
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            where = f"logit_bias/allowed_token_ids are outside the vocabulary [0, {self.vocab_size})"
            return f"request {seq.seq_id}: token ids {bad[:5]} in {where}"
        row = _Row(p, bad_word_token_ids(self.tokenizer, p.bad_words))
        if p.structured is not None:
            try:
                row.matcher = self.grammars.matcher(p.structured)
            except StructuredError as exc:
                return f"request {seq.seq_id}: invalid_structured: {exc}"
        self._rows[seq.seq_id] = row
        return None

    def release(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    def terminated(self, seq_id: int) -> bool:
        """The request's grammar has accepted a complete output (it should finish with "stop")."""
        row = self._rows.get(seq_id)
        return row is not None and row.terminated

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Processed logits (a new tensor when any row uses a feature; `logits` itself otherwise)."""
        picked = [(i, row) for i, s in enumerate(seqs) if (row := self._rows.get(s.seq_id)) is not None]
        if not picked:
            return logits
        index = torch.tensor([i for i, _ in picked], device=logits.device)
        sub = logits[index].float()  # [m, V] a copy: the caller's logits stay intact
        rows = [row for _, row in picked]
        for row, seq in zip(rows, (seqs[i] for i, _ in picked)):
            self._fold(row, seq, sub.device)
        self._mask_and_bias(sub, rows, [seqs[i] for i, _ in picked])
        _penalize(sub, rows)
        constrained = [j for j, row in enumerate(rows) if row.matcher is not None and not row.terminated]
        if constrained:
            mask_rows(sub, constrained, [rows[j].matcher for j in constrained])
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()  # .float() copies already
        out[index] = sub
        return out

    def accept(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """After the draw: structured rows' matchers take their token."""
        for seq, token in zip(seqs, tokens):
            row = self._rows.get(seq.seq_id)
            if row is None or row.matcher is None or row.terminated:
                continue
            if not row.matcher.accept_token(token):
                logger.warning("request %d: the grammar refused token %d; ending it", seq.seq_id, token)
                row.terminated = True
                continue
            row.terminated = bool(row.matcher.is_terminated())

    # ------------------------------------------------------------------ helpers

    def _fold(self, row: _Row, seq: Sequence, device: torch.device) -> None:
        """Bring `seen` and `counts` up to date with the tokens appended since the last step."""
        p = row.params
        new = seq.token_ids[row.folded :]
        if not new:
            return
        if p.repetition_penalty != 1.0:
            if row.seen is None:
                row.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=device)
            row.seen[torch.tensor(new, device=device)] = True
        if p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            if row.counts is None:
                row.counts = torch.zeros(self.vocab_size, dtype=torch.float32, device=device)
            out_new = seq.token_ids[max(row.folded, seq.num_prompt_tokens) :]
            if out_new:
                ids = torch.tensor(out_new, device=device)
                row.counts.index_add_(0, ids, torch.ones(len(out_new), device=device))
        row.folded = seq.num_tokens

    def _mask_and_bias(self, sub: torch.Tensor, rows: list[_Row], seqs: list[Sequence]) -> None:
        """allowed_token_ids, bad_words (-inf) and logit_bias (added), each in one indexed write."""
        allowed = [(j, row.params.allowed_token_ids) for j, row in enumerate(rows) if row.params.allowed_token_ids]
        if allowed:
            keep = torch.zeros((len(allowed), sub.shape[1]), dtype=torch.bool, device=sub.device)
            for k, (_, ids) in enumerate(allowed):
                keep[k, torch.tensor(ids, device=sub.device)] = True
            index = torch.tensor([j for j, _ in allowed], device=sub.device)
            sub[index] = sub[index].masked_fill(~keep, float("-inf"))
        banned: list[tuple[int, int]] = []
        for j, (row, seq) in enumerate(zip(rows, seqs)):
            for word in row.bad_words:
                prefix = word[:-1]
                if not prefix or tuple(seq.token_ids[-len(prefix) :]) == prefix:
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


def _penalize(sub: torch.Tensor, rows: list[_Row]) -> None:
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
