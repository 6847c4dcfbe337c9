"""The usage counters every bill is built from: row outcomes and token totals (Totals), and exact
integer histograms of token lengths (IntHistogram). The run's summary and manifest, the report and
the estimate all count with these."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Totals:
    """Usage totals over output rows: the summary line, the manifest and the report share them."""

    rows: int = 0
    ok_rows: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0  # of output_tokens: thinking (output.reasoning auto), billed as output
    finish_reasons: dict[str, int] = field(default_factory=dict)
    error_codes: dict[str, int] = field(default_factory=dict)
    # A job with LoRA adapters: adapter name ("(base)": none) -> rows, ok, input, cached, output
    by_lora: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def error_rows(self) -> int:
        return self.rows - self.ok_rows

    def add_part(self, columns: dict[str, list[Any]], adapters: str | None = None) -> None:
        """Finish reasons are counted per sample: a job with n > 1 has a list of n per row.
        `adapters`: the column of `columns` that is batchgen's adapter column (adapter_field
        decides; never a column merely named `lora`), counted per adapter; None: none."""
        for reason, code in zip(columns["finish_reason"], columns["error_code"]):
            self.rows += 1
            for one in reason if isinstance(reason, list) else [reason]:
                add_counts(self.finish_reasons, {one: 1})
            if code is None:
                self.ok_rows += 1
            else:
                add_counts(self.error_codes, {code: 1})
        self.input_tokens += sum(columns["input_tokens"])
        self.cached_tokens += sum(columns["cached_tokens"])
        self.output_tokens += sum(columns["output_tokens"])
        self.reasoning_tokens += sum(columns.get("reasoning_tokens") or [])
        if adapters is not None:
            self._add_adapters(columns, columns[adapters])

    def _add_adapters(self, columns: dict[str, list[Any]], adapters: list[str | None]) -> None:
        names = ("input_tokens", "cached_tokens", "output_tokens")
        for i, adapter in enumerate(adapters):
            one = self.by_lora.setdefault(BASE_NAME if adapter is None else adapter, _adapter_counts())
            one["rows"] += 1
            one["ok"] += columns["error_code"][i] is None
            for name in names:
                one[name.removesuffix("_tokens")] += columns[name][i]

    def merge(self, other: Totals) -> None:
        for name in ("rows", "ok_rows", "input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        add_counts(self.finish_reasons, other.finish_reasons)
        add_counts(self.error_codes, other.error_codes)
        for adapter, counts in other.by_lora.items():
            add_counts(self.by_lora.setdefault(adapter, _adapter_counts()), counts)


BASE_NAME = "(base)"  # rows of the base model in per-adapter totals (no adapter is named so: job/sections)


def _adapter_counts() -> dict[str, int]:
    return dict.fromkeys(("rows", "ok", "input", "cached", "output"), 0)


def add_counts(into: dict[str, int], counts: dict[str, int]) -> None:
    for key, count in counts.items():
        into[key] = into.get(key, 0) + count


@dataclass
class IntHistogram:
    """Exact counts of integer values (token lengths): sorted distinct values and their counts."""

    values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [distinct], ascending
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [distinct]

    def add_many(self, values: np.ndarray, counts: np.ndarray | None = None) -> None:
        """Count each of `values` (`counts[i]` times when given); vectorized, no per-value Python."""
        values = np.asarray(values, np.int64)
        counts = np.ones(len(values), np.int64) if counts is None else np.asarray(counts, np.int64)
        merged, inverse = np.unique(np.concatenate([self.values, values]), return_inverse=True)
        summed = np.zeros(len(merged), np.int64)
        np.add.at(summed, inverse, np.concatenate([self.counts, counts]))
        self.values, self.counts = merged, summed

    def merge(self, other: IntHistogram) -> None:
        self.add_many(other.values, other.counts)

    @property
    def n(self) -> int:
        return int(self.counts.sum())

    def mean(self) -> float | None:
        return int((self.values * self.counts).sum()) / self.n if self.n else None

    def max(self) -> int | None:
        return int(self.values[-1]) if len(self.values) else None

    def percentile(self, q: float) -> int | None:
        """Nearest-rank percentile: the smallest value with at least q% of the values <= it."""
        if not self.n:
            return None
        rank = max(1, math.ceil(q / 100 * self.n))
        return int(self.values[np.searchsorted(np.cumsum(self.counts), rank)])
