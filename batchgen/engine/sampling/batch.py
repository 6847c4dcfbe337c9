"""SamplingBatch: the runner side's persistent per-row sampling state, updated only from the scheduler's diffs.

Why (vLLM v1's InputBatch): one object holds every row's state. A row is made for a new sequence
and dropped when it finishes (a preempted one keeps it); a step's view (`step`) is staged once and
reused while the step's rows are unchanged; seeded rows own a device generator; `accept` advances
the host state after the step's one read. The ModelRunner owns one; nothing here reads a Sequence.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.scheduler_output import BatchUpdate, NewSequence
from batchgen.engine.sampling.logprobs import LogprobRows
from batchgen.engine.sampling.penalties import FeaturePlan, FeatureRow, LogitsFeatures, plan_features
from batchgen.engine.staging.transfers import Transfers

NO_TOP_K = float(1 << 30)  # a disabled top-k: above any vocabulary, so the filter keeps every token
_PARAMS = 4  # temperature, top_k, top_p, min_p


@dataclass
class SamplingStep:
    """One step's rows as the sampler reads them; `seq_ids[i]` is row i of the step's logits. Its
    tensors are kept while the rows are unchanged; `banned` is staged each step (Sampler.prepare)."""

    seq_ids: tuple[int, ...]
    rows: list[int]  # each one's row in the batch
    sample_rows: list[int]  # step rows that sample (not greedy), ascending
    params: torch.Tensor | None  # [len(sample_rows), 4] on the device (see _PARAMS); None: all greedy
    sample_index: torch.Tensor | None  # sample_rows on the device, when only some rows sample
    top_ks: list[int]  # the enabled top-k of the sampling rows (for the widest filter)
    need_p: bool  # some sampling row uses top-p
    need_min_p: bool  # some sampling row uses min-p
    seeded: list[int]  # positions in sample_rows whose row draws from its own generator
    generators: list[torch.Generator]  # theirs, in the same order
    unseeded_index: torch.Tensor | None  # positions in sample_rows of the others (when both kinds are there)
    logprobs: LogprobRows | None  # the rows that ask for logprobs, and their K; None: no row asks
    features: FeaturePlan | None  # the rows with logits features; None: no row has one
    grammars: bool  # some row has a grammar (it may end the request)
    min_tokens: list[tuple[int, int]]  # (step row, batch row) of rows with min_tokens > 0
    may_read: bool  # a device value may be read mid-step for free (the CPU, where nothing is copied)
    batch: SamplingBatch = field(repr=False)  # whose rows these are (their counts and features)
    banned: torch.Tensor | None = None  # this step's (step row, token) [2, n] masked for min_tokens
    _max_k: dict[int, int] = field(default_factory=dict)

    def max_k(self, vocab: int) -> int:
        """The largest top-k below `vocab` (0: no row filters by top-k); once per vocabulary width."""
        k = self._max_k.get(vocab)
        if k is None:
            k = self._max_k[vocab] = max((k for k in self.top_ks if k < vocab), default=0)
        return k


@dataclass
class _Row:
    """One sequence's host state (its parameters also sit in the batch's table, for the device)."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded and not greedy: its own
    feature: FeatureRow | None  # penalties, bias, bad words, grammar
    prompt: tuple[int, ...]  # scored when it asks for prompt logprobs
    num_output: int = 0  # tokens accepted (min_tokens)


class SamplingBatch:
    """Rows of sampling state for the sequences the runner knows, by seq id."""

    def __init__(self, device: torch.device, features: LogitsFeatures, transfers: Transfers) -> None:
        """`features`: the sampler's (penalties, bans, grammars); `transfers`: where the rows' device
        inputs are staged (the runner's; the hf backend's seeded draw has one of its own)."""
        self.device = device
        self.features = features
        self.transfers = transfers
        self._row_of: dict[int, int] = {}
        self._free: list[int] = []  # rows left by finished sequences, taken first (lowest first)
        self._table = torch.zeros((0, _PARAMS), dtype=torch.float32)  # [capacity, 4] host
        self._rows: list[_Row | None] = []  # None: a free row
        self._last: SamplingStep | None = None  # the last step's view, reused while nothing changes

    # ------------------------------------------------------------- the diff

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def apply(self, update: BatchUpdate) -> None:
        """Finished sequences lose their rows, new ones get theirs; preempted and resumed ones keep theirs."""
        self.remove(update.finished)
        for new in update.new:
            self.add(new)

    def add(self, new: NewSequence) -> int:
        """A row for a new sequence; returns it."""
        if new.seq_id in self._row_of:
            raise ValueError(f"seq {new.seq_id} already has a sampling row")
        row = heapq.heappop(self._free) if self._free else self._grow()
        p = new.params
        self._row_of[new.seq_id] = row
        self._table[row] = torch.tensor([p.temperature, p.top_k or NO_TOP_K, p.top_p, p.min_p])
        generator = None
        if p.seed is not None and not p.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(p.seed))
        feature = None
        if p.uses_logits_features:
            feature = self.features.row(new.seq_id, new.prompt_token_ids, p, self.device, self.transfers)
        self._rows[row] = _Row(p, generator, feature, new.prompt_token_ids)
        self._last = None
        return row

    def remove(self, seq_ids: Iterable[int]) -> None:
        """Drop the rows of `seq_ids` (ids without one are ignored: never admitted, or already gone)."""
        for seq_id in seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is None:
                continue
            feature = self._rows[row].feature  # type: ignore[union-attr]  # a live row
            if feature is not None:
                self.features.release(feature)
            self._rows[row] = None
            heapq.heappush(self._free, row)
            self._last = None

    def clear(self) -> None:
        """Drop every row (an aborted generate)."""
        self.remove(list(self._row_of))
        self._free = []
        self._table = self._table[:0]
        self._rows = []
        self.features.clear()

    def _grow(self) -> int:
        row = len(self._rows)
        if row == self._table.shape[0]:
            grown = torch.zeros((max(8, 2 * row), _PARAMS), dtype=torch.float32)
            grown[:row] = self._table
            self._table = grown
        self._rows.append(None)
        return row

    # --------------------------------------------------------------- a step

    def step(self, seq_ids: Sequence[int]) -> SamplingStep:
        """The view of these rows (in this order), staged for the next upload; the last one when it
        was for the same ids and no row changed (its kept tensors are on the device already)."""
        last = self._last
        ids = tuple(seq_ids)  # why a tuple: the scheduler's draws are one, so this costs nothing
        if last is not None and last.seq_ids == ids:
            return last
        self._last = self._build(ids)
        return self._last

    def accept(self, step: SamplingStep, tokens: list[int]) -> None:
        """Each step row's sampled token (`tokens[i]` for row i), as read: output counts and the
        features' host state advance (their device history advanced with the draw)."""
        for _, row in step.min_tokens:
            self._rows[row].num_output += 1  # type: ignore[union-attr]  # a live row
        if step.features is not None:
            self.features.accept(step.features.picked, tokens)

    def terminated(self, seq_id: int) -> bool:
        """The sequence's grammar has accepted a complete output."""
        feature = self._live(seq_id).feature
        return feature is not None and feature.terminated

    def short_rows(self, step: SamplingStep) -> list[tuple[int, list[int]]]:
        """(step row, its stop token ids) of the rows still short of min_tokens."""
        rows = [(i, self._rows[r]) for i, r in step.min_tokens]
        return [(i, r.params.stop_token_ids) for i, r in rows if r is not None and r.num_output < r.params.min_tokens]

    def prompt(self, seq_id: int) -> tuple[tuple[int, ...], int]:
        """The prompt of a row that asked for prompt logprobs, and its K."""
        row = self._live(seq_id)
        return row.prompt, int(row.params.prompt_logprobs or 0)

    def _live(self, seq_id: int) -> _Row:
        row = self._rows[self._row_of[seq_id]]
        if row is None:
            raise KeyError(f"seq {seq_id} has no sampling row")
        return row

    def _build(self, seq_ids: tuple[int, ...]) -> SamplingStep:
        rows = [self._row_of[s] for s in seq_ids]
        live = [self._live(s) for s in seq_ids]
        params = [r.params for r in live]
        sample_rows = [i for i, p in enumerate(params) if not p.greedy]
        sampled = [params[i] for i in sample_rows]
        stage = self.transfers.stage
        table = index = unseeded = None
        if sample_rows:
            picked = rows if len(sample_rows) == len(rows) else [rows[i] for i in sample_rows]
            # why one tensor: all per-row parameters in one piece of the step's upload, once per batch
            table = stage(self._table[torch.tensor(picked)], keep=True)  # [m, 4]
            if len(sample_rows) < len(rows):
                index = stage(torch.tensor(sample_rows), keep=True)
        seeded = [j for j, i in enumerate(sample_rows) if live[i].generator is not None]
        if seeded and len(seeded) < len(sample_rows):
            others = sorted(set(range(len(sample_rows))) - set(seeded))
            unseeded = stage(torch.tensor(others), keep=True)
        picked_features = [(i, r.feature) for i, r in enumerate(live) if r.feature is not None]
        plan = plan_features(picked_features, self.transfers) if picked_features else None
        asks = [i for i, p in enumerate(params) if p.logprobs is not None]  # rows that ask for logprobs
        asks_index = stage(torch.tensor(asks), keep=True) if 0 < len(asks) < len(rows) else None
        return SamplingStep(
            seq_ids=seq_ids,
            rows=rows,
            sample_rows=sample_rows,
            params=table,
            sample_index=index,
            top_ks=[p.top_k for p in sampled if p.top_k],
            need_p=any(p.top_p < 1.0 for p in sampled),
            need_min_p=any(p.min_p > 0.0 for p in sampled),
            seeded=seeded,
            generators=[live[sample_rows[j]].generator for j in seeded],  # type: ignore[misc]  # seeded
            unseeded_index=unseeded,
            logprobs=LogprobRows(asks, [params[i].logprobs or 0 for i in asks], asks_index) if asks else None,
            features=plan,
            grammars=any(f.matcher is not None for _, f in picked_features),
            min_tokens=[(i, rows[i]) for i, p in enumerate(params) if p.min_tokens > 0],
            may_read=self.device.type == "cpu" and not self.transfers.copy,
            batch=self,
        )
