"""Log-probabilities of the model's raw distribution, for `logprobs` and `prompt_logprobs`.

vLLM v1's default (`raw_logprobs`): log_softmax of the logits as the model produced them, before
any mask, penalty or temperature (greedy ones equal transformers' `compute_transition_scores`).
Scored on the device (`score`), read in the step's one read, made outputs by `entries`; nothing
runs for rows that asked for none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from batchgen.engine.api.outputs import Logprob, PositionLogprobs


@dataclass
class LogprobRows:
    """Rows of a step's logits whose logprobs are wanted, each with its K (top alternatives)."""

    rows: list[int]
    ks: list[int]
    index: torch.Tensor | None  # `rows` on the device [r]; None: every row, in order


def raw_logprobs(logits: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """logits [n, V] -> log_softmax of the rows `index` [r] (None: all), [r, V] float32."""
    picked = logits if index is None else logits.index_select(0, index)
    return torch.log_softmax(picked.float(), dim=-1)


def score(logprobs: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> list[torch.Tensor]:
    """On the device: each row's target logprob [r] and rank [r] (1-based, ties share), then, when
    some K > 0, the top-K values and ids [r, K] (K the largest asked). What `entries` reads back."""
    chosen = logprobs.gather(1, targets[:, None])  # [r, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [r]
    out = [chosen[:, 0], ranks]
    top_k = min(max(ks, default=0), logprobs.shape[-1])
    if top_k:
        top_values, top_ids = logprobs.topk(top_k, dim=-1)  # [r, K] each, descending
        out += [top_values, top_ids]
    return out


def entries(
    read: list[Any], ks: list[int], targets: list[int], texts: Callable[[int], str]
) -> list[tuple[PositionLogprobs, float]]:
    """`score`'s tensors as read back (flat lists) -> for each row ({target and top-K ids: Logprob},
    the target's logprob). `targets[j]` is row j's."""
    if len(targets) != len(ks):
        raise ValueError(f"{len(targets)} target tokens for {len(ks)} logprob rows")
    values, ranks = read[0], read[1]
    top_v: list[float] = read[2] if len(read) > 2 else []
    top_i: list[int] = read[3] if len(read) > 2 else []
    width = len(top_i) // len(targets) if targets else 0
    out: list[tuple[PositionLogprobs, float]] = []
    for j, token in enumerate(targets):
        entry: PositionLogprobs = {token: Logprob(values[j], ranks[j], texts(token))}
        a = j * width
        for rank, (tid, value) in enumerate(zip(top_i[a : a + ks[j]], top_v[a : a + ks[j]]), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, texts(tid))
        out.append((entry, values[j]))
    return out
