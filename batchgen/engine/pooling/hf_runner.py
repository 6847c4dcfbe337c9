"""Pooling batches through transformers' own forward, for encoder models (bidirectional attention,
which the causal paged attention cannot run), in length order under a padded-size token budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

from batchgen.engine.pooling.poolers import pool_padded


@dataclass(frozen=True)
class Encoded:
    """One tokenized input: its ids and, for a (query, document) pair on BERT-style models, the
    segment ids the tokenizer made."""

    input_ids: list[int]
    token_type_ids: list[int] | None = None


def is_encoder(config: PretrainedConfig) -> bool:
    """BERT-style (bidirectional) models: the families transformers trains with masked LM."""
    return config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False)


def token_batches(lengths: list[int], budget: int, max_rows: int) -> list[list[int]]:
    """Indices longest first, cut into batches whose padded size (rows x longest) stays within
    `budget` tokens (a single longer row is a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget and len(batches[-1]) < max_rows:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class HFPoolingRunner:
    """A transformers model for pooling: `kind` "embed" (AutoModel: hidden states) or "classify"
    (AutoModelForSequenceClassification: logits)."""

    def __init__(
        self, path: str | Path, kind: str, device: torch.device, dtype: torch.dtype, budget: int, max_rows: int = 256
    ) -> None:
        self.config = AutoConfig.from_pretrained(path)
        loader: Any = AutoModel if kind == "embed" else AutoModelForSequenceClassification
        self.model = loader.from_pretrained(path, dtype=dtype).to(device).eval()
        self.kind, self.device, self.budget, self.max_rows = kind, device, budget, max_rows
        self.pad_id = int(self.config.pad_token_id if self.config.pad_token_id is not None else 0)

    def run(
        self, inputs: list[Encoded], method: str = "cls", on_step: Callable[[], None] | None = None
    ) -> list[torch.Tensor]:
        """Per input, in order: its pooled hidden state [H] (embed) or its head's logits [C]
        (classify), float32 on the CPU. `on_step` runs after every batch."""
        out: list[torch.Tensor | None] = [None] * len(inputs)
        for batch in token_batches([len(e.input_ids) for e in inputs], self.budget, self.max_rows):
            rows = self._forward([inputs[i] for i in batch], method)  # [B, H] or [B, C]
            for i, row in zip(batch, rows.float().cpu()):
                out[i] = row
            if on_step is not None:
                on_step()
        return [t for t in out if t is not None]

    def _forward(self, rows: list[Encoded], method: str) -> torch.Tensor:
        longest = max(len(e.input_ids) for e in rows)
        ids = torch.full((len(rows), longest), self.pad_id, dtype=torch.long)  # [B, L], right padding
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        types = torch.zeros((len(rows), longest), dtype=torch.long)
        for b, e in enumerate(rows):
            n = len(e.input_ids)
            ids[b, :n], mask[b, :n] = torch.tensor(e.input_ids), 1
            if e.token_type_ids is not None:
                types[b, :n] = torch.tensor(e.token_type_ids)
        args: dict[str, torch.Tensor] = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if any(e.token_type_ids is not None for e in rows):
            args["token_type_ids"] = types.to(self.device)
        with torch.inference_mode():
            if self.kind == "embed":
                hidden = self.model(**args).last_hidden_state  # [B, L, H]
                return pool_padded(hidden, args["attention_mask"], method)
            return self.model(**args).logits  # [B, C]: the model's own pooler and head
