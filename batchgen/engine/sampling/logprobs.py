"""Log-probabilities of the model's raw distribution, for `logprobs` and `prompt_logprobs`.

Follows vLLM v1's default (`raw_logprobs`): log_softmax of the logits as the model produced them,
before min_tokens masks, penalties, biases, grammar masks, temperature and top-k/p/min-p. So a
sampled token's logprob says how likely the model found it, not how likely the filtered
sampler made it, and greedy logprobs equal transformers' `compute_transition_scores` of
`generate(output_logits=True)`'s raw logits. The engine takes them from the runner's logits
before the sampler runs (the sampler may work on them), and resolves the chosen tokens after.
Nothing here runs for rows that asked for none: no cost without the feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.api.outputs import Logprob, PositionLogprobs


class TokenTexts:
    """Each token id's own text (vLLM's `decoded_token`), decoded once and cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


@dataclass
class PendingLogprobs:
    """Log-softmax of some rows of a step's logits, waiting for the tokens whose logprob is wanted.

    rows: indices into the step's logits rows; ks: each row's K; logprobs: [len(rows), V] float32;
    top_values / top_ids: [len(rows), max K] (None when every K is 0).
    """

    rows: list[int]
    ks: list[int]
    logprobs: torch.Tensor
    top_values: torch.Tensor | None
    top_ids: torch.Tensor | None

    def resolve(self, targets: list[int], texts: TokenTexts) -> list[tuple[PositionLogprobs, float]]:
        """For each row: ({target and top-K ids: Logprob}, the target's logprob). `targets[j]` is row j's."""
        if len(targets) != len(self.rows):
            raise ValueError(f"{len(targets)} target tokens for {len(self.rows)} logprob rows")
        chosen = torch.tensor(targets, device=self.logprobs.device)[:, None]  # [r, 1]
        chosen_lp = self.logprobs.gather(1, chosen)  # [r, 1]
        ranks = ((self.logprobs > chosen_lp).sum(dim=-1) + 1).tolist()  # [r] 1-based, ties share
        values = chosen_lp[:, 0].tolist()
        top_v = self.top_values.tolist() if self.top_values is not None else [[] for _ in self.rows]
        top_i = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in self.rows]
        out: list[tuple[PositionLogprobs, float]] = []
        for j, token in enumerate(targets):
            entry: PositionLogprobs = {token: Logprob(values[j], ranks[j], texts(token))}
            for rank, (tid, value) in enumerate(zip(top_i[j][: self.ks[j]], top_v[j][: self.ks[j]]), start=1):
                if tid not in entry:
                    entry[tid] = Logprob(value, rank, texts(tid))
            out.append((entry, values[j]))
        return out


def take_logprobs(logits: torch.Tensor, ks: list[int | None]) -> PendingLogprobs | None:
    """Log-softmax of the rows whose K is not None (logits: [rows, V]); None when no row asks."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return None
    wanted = [int(ks[i]) for i in rows]  # type: ignore[arg-type]  # not None: filtered above
    index = torch.tensor(rows, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [r, V]
    top_k = min(max(wanted), logprobs.shape[-1])
    if top_k == 0:
        return PendingLogprobs(rows, wanted, logprobs, None, None)
    top_values, top_ids = logprobs.topk(top_k, dim=-1)  # [r, K] each, descending
    return PendingLogprobs(rows, wanted, logprobs, top_values, top_ids)
