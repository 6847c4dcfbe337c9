"""Poolers: a sequence's hidden states -> one vector (last token, mean, CLS), then Matryoshka
truncation and L2 normalization; and the classifier head's logits -> probabilities / a score.

Why an accumulator: chunked prefill delivers hidden states piece by piece.
"""

from __future__ import annotations

import torch

from batchgen.engine.pooling.config import PoolingConfig


class PoolAccumulator:
    """One sequence's pooled state while its chunks run (positions start .. start + n - 1 each)."""

    def __init__(self, method: str, num_tokens: int) -> None:
        self.method = method
        self.num_tokens = num_tokens
        self.total: torch.Tensor | None = None  # [H] float32: the sum (mean) or the chosen row
        self.seen = 0  # tokens whose hidden states were added (mean: must reach num_tokens)

    def add(self, start: int, hidden: torch.Tensor) -> None:
        """`hidden` [n, H]: the hidden states of positions start .. start + n - 1."""
        n = hidden.shape[0]
        if self.method == "mean":
            part = hidden.float().sum(dim=0)  # [H]
            self.total = part if self.total is None else self.total + part
        elif self.method == "cls" and start == 0:
            self.total = hidden[0].float()
        elif self.method == "last" and start + n == self.num_tokens:
            self.total = hidden[-1].float()
        self.seen += n

    def result(self) -> torch.Tensor:
        """The pooled vector [H] float32 (before truncation and normalization)."""
        if self.total is None:
            raise RuntimeError(f"{self.method} pooling: the position it needs was never computed")
        if self.method == "mean":
            if self.seen != self.num_tokens:  # why: a cached prefix has no hidden states to average
                raise RuntimeError(f"mean pooling saw {self.seen} of {self.num_tokens} tokens")
            return self.total / self.num_tokens
        return self.total


def pool_padded(hidden: torch.Tensor, mask: torch.Tensor, method: str) -> torch.Tensor:
    """`hidden` [B, L, H], `mask` [B, L] (1 = token, right padding) -> [B, H] float32."""
    hidden = hidden.float()
    if method == "cls":
        return hidden[:, 0]
    if method == "last":
        last = mask.sum(dim=1) - 1  # [B]: the last real position (right padding)
        return hidden[torch.arange(hidden.shape[0]), last]
    weights = mask.unsqueeze(-1).float()  # [B, L, 1]
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1)


def finish_embeddings(vectors: torch.Tensor, config: PoolingConfig) -> torch.Tensor:
    """[N, H] float32 -> [N, D]: the first `dimensions` values (Matryoshka), then L2-normalized."""
    if config.dimensions is not None:
        if config.dimensions > vectors.shape[-1]:
            raise ValueError(f"dimensions {config.dimensions} exceeds the model's hidden size {vectors.shape[-1]}")
        vectors = vectors[..., : config.dimensions]
    if config.normalize:
        vectors = torch.nn.functional.normalize(vectors, p=2.0, dim=-1)
    return vectors


def head_probs(logits: torch.Tensor) -> torch.Tensor:
    """Classifier logits [N, C] -> probabilities: softmax over labels, sigmoid for a single label
    (as transformers' pipeline, vLLM and sentence-transformers' CrossEncoder do)."""
    logits = logits.float()
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine similarity of [N, D] and [N, D] -> [N] (vLLM's score for embedding models)."""
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
