"""`batchgen estimate`: the input half of a job's bill before it runs. Reads and tokenizes the inputs
exactly as `run` does (same checks, the same parts: the job's prefix plan when it groups, and
RowPreparer), loads no weights, and predicts the prefix-cache hits by replaying the engine's
full-block chained prefix matching over each ordered part; a part that goes on with the previous
part's group (a group larger than a part) is replayed after it with the cache kept, as the one
process or worker that runs both keeps it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import numpy as np

from batchgen.engine.attention.path import SMALL_BLOCK_SIZE
from batchgen.engine.core.block_hash import block_extra_key
from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras
from batchgen.engine.runner.models import resolve_max_model_len
from batchgen.errors import ModelError
from batchgen.inputs.dataset import plan_shards
from batchgen.inputs.duplicate_ids import find_duplicate_ids
from batchgen.inputs.grouping import grouped
from batchgen.inputs.ordering import Strategy, order_requests
from batchgen.inputs.part_rows import GroupedPart, read_parts
from batchgen.inputs.prepare import RowPreparer, input_columns, load_tokenizer
from batchgen.inputs.prepared_row import PreparedRow
from batchgen.inputs.vision_rows import wave_rows
from batchgen.job.spec import JobSpec
from batchgen.outputs.totals import BASE_NAME, IntHistogram
from batchgen.run.validate import validate_job
from batchgen.usage.pricing import (
    Prices,
    add_costs,
    estimate_adapter_costs,
    input_cost,
    money_display,
    money_text,
    output_cost,
)

log = logging.getLogger(__name__)
MAX_ERROR_EXAMPLES = 5


@dataclass
class Estimate:
    """What `run` would bill for the prompts, and at most how much it could generate."""

    context_length: int
    cache_enabled: bool  # native backend with enable_prefix_caching: cached_tokens will be billed
    rows: int = 0
    ok_rows: int = 0
    input_tokens: int = 0  # ok rows only: an error row is billed nothing
    shareable_tokens: int = 0  # prompt tokens a prefix cache would serve, whatever the backend
    max_output_tokens: int = 0  # sum of each ok row's max_tokens (after the cap to the context) x its n samples
    error_codes: dict[str, int] = field(default_factory=dict)
    error_examples: list[str] = field(default_factory=list)
    input_lengths: IntHistogram = field(default_factory=IntHistogram)
    generates: bool = True  # False for a pooling task (embed, classify, score): no output tokens
    parts: int = 0  # parts the job is cut into (the prefix plan's, when it groups)
    adapters: bool = False  # the job has LoRA adapters (model.lora): usage is counted per adapter too
    # adapter ("(base)": none) -> rows, input, shareable, output_max
    by_lora: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def cached_tokens(self) -> int:
        return self.shareable_tokens if self.cache_enabled else 0

    def add_window(
        self, rows: list[PreparedRow], ordering: Strategy, block_size: int, cache: dict[Any, int] | None = None
    ) -> None:
        """One part's rows; `cache`: the prefix cache this part starts with (kept across calls)."""
        ok = [r.request() for r in rows if r.ok]
        named = [r.adapter for r in rows if r.ok]
        self.rows += len(rows)
        self.ok_rows += len(ok)
        lengths = [len(ids) for ids, _ in ok]
        self.input_tokens += sum(lengths)
        self.input_lengths.add_many(np.array(lengths, np.int64))
        if self.generates:
            self.max_output_tokens += sum((params.max_tokens or 0) * params.n for _, params in ok)
        for r in rows:
            if r.error_code is not None:
                self.error_codes[r.error_code] = self.error_codes.get(r.error_code, 0) + 1
                if len(self.error_examples) < MAX_ERROR_EXAMPLES:
                    self.error_examples.append(f"{r.error_code}: {r.error_message}")
        prompts = [ids for ids, _ in ok]
        order = order_requests(prompts, ordering, named if any(named) else None)
        roots: list[Any] = [-1 if named[i] is None else ("lora", named[i]) for i in order]  # an adapter's own blocks
        hits: list[int] = []
        extras = [r.extras() for r in rows if r.ok]  # an image row's images join its blocks' keys
        ordered = [prompts[i] for i in order]
        self.shareable_tokens += prefix_cache_hits(ordered, block_size, cache, roots, hits, [extras[i] for i in order])
        if self.adapters:  # (every window: one of base rows only counts too)
            self._add_adapters(rows, [ok[i] for i in order], [named[i] for i in order], hits)

    def _add_adapters(self, rows: list[PreparedRow], ok: list[Any], named: list[str | None], hits: list[int]) -> None:
        """Rows, input tokens, shareable tokens and the output ceiling per adapter (pricing.lora)."""

        def counts(name: str | None) -> dict[str, int]:
            empty = dict.fromkeys(("rows", "input", "shareable", "output_max"), 0)
            return self.by_lora.setdefault(BASE_NAME if name is None else name, empty)

        for r in rows:
            counts(r.adapter)["rows"] += 1
        for (ids, params), name, hit in zip(ok, named, hits):
            one = counts(name)
            one["input"] += len(ids)
            one["shareable"] += hit
            one["output_max"] += (params.max_tokens or 0) * params.n if self.generates else 0


def prefix_cache_hits(
    prompts: list[list[int]],
    block_size: int,
    nodes: dict[Any, int] | None = None,
    roots: list[Any] | None = None,
    each: list[int] | None = None,
    extras: list[RequestExtras] | None = None,
) -> int:
    """Prompt tokens served from the cache when `prompts` are admitted in this order.

    As the engine's block manager does: only full blocks match, as a chain from the first token;
    at least one token of each prompt is computed (its logits are needed); every full prompt
    block is cached once computed. The cache is assumed unbounded (nothing is evicted). `nodes`:
    the cache to start from and add to, (parent node, block tokens, extra key) -> node id; None:
    empty. `roots`: per prompt, the parent of its first block (-1: the base model's; a LoRA
    adapter's blocks chain from its own, so no block is shared across adapters). `each`: gets each
    prompt's hits. `extras`: each prompt's RequestExtras (its images): a block's extra key as the
    block hash has it (core/block_hash), so two images of one size never share a block.
    """
    nodes = {} if nodes is None else nodes
    hits = 0
    for j, ids in enumerate(prompts):
        before = hits
        request = extras[j] if extras is not None else NO_EXTRAS
        max_match = (len(ids) - 1) // block_size
        parent = -1 if roots is None else roots[j]
        for b in range(len(ids) // block_size):
            first, end = b * block_size, (b + 1) * block_size
            key = (parent, tuple(ids[first:end]), block_extra_key(request, first, end))
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(nodes)
            elif b < max_match:
                hits += block_size  # why: a chained key hits only if every earlier block hit too
            parent = node
        if each is not None:
            each.append(hits - before)
    return hits


def estimate_job(spec: JobSpec) -> Estimate:
    files = validate_job(spec)  # the same checks `run` makes before loading weights
    tokenizer = load_tokenizer(spec.model.path)
    max_len = _context_length(spec)
    engine = spec.engine
    cache = engine.backend == "native" and engine.enable_prefix_caching
    if spec.task != "generate":  # only last-token embeddings of a decoder reuse a prefix (engine/pooling)
        from batchgen.engine.pooling.model import prefix_cache_applies

        pooling_type = spec.pooling.pooling_type if spec.pooling is not None else None
        cache = cache and prefix_cache_applies(spec.model.path, spec.task, pooling_type)
    est = Estimate(max_len, cache, generates=spec.task == "generate", adapters=bool(spec.model.lora))
    preparer = RowPreparer(spec, tokenizer, max_len)
    shards = plan_shards(files, engine.window_rows, spec.input.limit)
    duplicates = find_duplicate_ids(files, shards, spec.input.id_column) if spec.input.id_column else {}
    parts = shards if not grouped(spec, with_cache=True) else _plan_parts(spec, files)
    kept: dict[Any, int] = {}
    for part in read_parts(files, list(parts), input_columns(spec), wave_rows(spec)):
        if not (isinstance(part.part, GroupedPart) and part.part.joined):
            kept = {}  # why: only a group's next part is sure to run where the last one left its cache
        rows = preparer.prepare_part(files, part, duplicates)
        est.add_window(rows, engine.ordering, block_size_of(spec), kept)
        log.info("estimated %d of %d parts", part.part.index + 1, len(parts))
    est.parts = len(parts)
    return est


def _plan_parts(spec: JobSpec, files: list[Any]) -> list[GroupedPart]:
    """The parts `run` would cut for this job (the same prefix plan)."""
    from batchgen.outputs.plan_file import grouped_layout
    from batchgen.run.layout import make_cut

    return [p for p in grouped_layout(make_cut(spec, files), stored=True).parts if isinstance(p, GroupedPart)]


def block_size_of(spec: JobSpec) -> int:
    """engine.block_size, else 16: the engine's default except on CUDA, where it may take 256
    (its Platform, engine/cuda/platform.py); set engine.block_size to estimate for that."""
    return int(spec.engine.block_size or SMALL_BLOCK_SIZE)


def _context_length(spec: JobSpec) -> int:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(spec.model.path)
        return resolve_max_model_len(config, spec.engine.max_model_len)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path {spec.model.path}: {exc}") from exc


def summary(est: Estimate, spec: JobSpec, prices: Prices) -> dict[str, Any]:
    """The estimate as JSON-ready data (money as exact decimal strings)."""
    hist, engine = est.input_lengths, spec.engine
    mean = hist.mean()
    return {
        "job": str(spec.source),
        "context_length": est.context_length,
        "dtype": _dtype(spec),
        "rows": {"total": est.rows, "ok": est.ok_rows, "error": est.rows - est.ok_rows},
        "error_codes": dict(sorted(est.error_codes.items())),
        "error_examples": est.error_examples,
        "input_tokens": {
            "total": est.input_tokens,
            "mean": None if mean is None else round(mean, 2),
            "p50": hist.percentile(50),
            "p95": hist.percentile(95),
            "max": hist.max(),
        },
        "prefix_cache": {
            "enabled": est.cache_enabled,
            "cached_tokens": est.cached_tokens,
            "shareable_tokens": est.shareable_tokens,
            "block_size": block_size_of(spec),
            "ordering": engine.ordering,
            "window_rows": engine.window_rows,
            "grouping": "prefix plan" if grouped(spec, with_cache=True) else "none",
            "parts": est.parts,
            "assumption": _cache_assumption(est, spec),
        },
        "output_tokens": {"min": 0, "max": est.max_output_tokens, "samples_per_row": spec.sampling.n},
        "prices": prices.as_json(),
        "cost": {k: money_text(v) for k, v in costs(est, prices).items()},
    } | ({"lora": dict(sorted(est.by_lora.items()))} if est.by_lora else {})


def costs(est: Estimate, prices: Prices) -> dict[str, Decimal | None]:
    """Input cost exactly (and with the cache discount when a cached_input price is given), output
    cost from zero to every row generating its max_tokens for each of its n samples (the prompt is
    prefilled once, so input is billed once); totals use the discounted input cost."""
    if prices.adapters and est.by_lora:  # adapters priced apart (pricing.lora): each at its own prices
        return estimate_adapter_costs(prices, est.by_lora, est.cache_enabled)
    plain = input_cost(prices, est.input_tokens, 0)
    cached = input_cost(prices, est.input_tokens, est.cached_tokens) if prices.cached_input is not None else None
    out_max = output_cost(prices, est.max_output_tokens)
    billed = cached if cached is not None else plain
    return {
        "input": plain,
        "input_with_cache": cached,
        "output_min": None if out_max is None else Decimal(0),
        "output_max": out_max,
        "total_min": billed,
        "total_max": add_costs(billed, out_max),
    }


def _cache_assumption(est: Estimate, spec: JobSpec) -> str:
    parts = (
        f"the job's {est.parts} parts of the prefix plan (rows sharing a prefix together, whole input)"
        if grouped(spec, with_cache=True)
        else f"{est.parts} parts of {spec.engine.window_rows} input rows in input order"
    )
    scope = (
        f"full blocks of {block_size_of(spec)} tokens, an unbounded cache within each of {parts}, in "
        f"'{spec.engine.ordering}' order, kept from a part to the next one of its group and nothing else "
        "counted across parts (a real KV pool can evict within a part and keep blocks across parts)"
    )
    if est.cache_enabled:
        return scope
    why = "the hf backend has no prefix cache" if spec.engine.backend == "hf" else "engine.enable_prefix_caching is off"
    if spec.task != "generate" and spec.engine.enable_prefix_caching:
        why = f"task {spec.task} with this model and pooling reuses no prefix (only last-token embeddings do)"
    return f"{why}, so 0 tokens will be cached; the native backend with caching would serve shareable_tokens ({scope})"


def _n(spec: JobSpec) -> str:
    n = spec.sampling.n
    return f", x {n} samples per row" if n > 1 else ""


def _discounted(cost: Decimal | None) -> str:
    return "" if cost is None else f" ({money_display(cost)} with the cache discount)"


def _token_stats(tok: dict[str, Any]) -> str:
    if tok["mean"] is None:  # why: mean, p50 ... of no rows are undefined, not "None"
        return f"total {tok['total']} (no row would run)"
    return "  ".join(f"{k} {tok[k]}" for k in ("total", "mean", "p50", "p95", "max"))


def _dtype(spec: JobSpec) -> dict[str, str]:
    """What model.dtype resolves to on this machine and why (the engine's dtype rule)."""
    from batchgen.engine.api.dtype_rule import for_job  # why lazy: it asks torch for CUDA

    choice = for_job(spec.model.dtype, spec.model.device, str(spec.model.path))
    return {"setting": spec.model.dtype, "resolved": choice.dtype, "why": choice.why}


def to_json(est: Estimate, spec: JobSpec, prices: Prices) -> str:
    return json.dumps(summary(est, spec, prices), indent=2) + "\n"  # why: text output ends with a newline


def to_text(est: Estimate, spec: JobSpec, prices: Prices) -> str:
    s = summary(est, spec, prices)
    tok, pc, c = s["input_tokens"], s["prefix_cache"], costs(est, prices)
    errors = ", ".join(f"{k} {v}" for k, v in s["error_codes"].items()) or "none"
    lines = [
        ("job", f"{s['job']} (context {est.context_length} tokens)"),
        ("dtype", f"{s['dtype']['setting']} -> {s['dtype']['resolved']} ({s['dtype']['why']})"),
        ("rows", f"{est.rows} ({est.ok_rows} ok; would fail: {errors})"),
        ("input tokens", _token_stats(tok)),
        *(("lora " + name, f"{c['rows']} rows, {c['input']} input tokens") for name, c in s.get("lora", {}).items()),
        ("prefix cache", f"{pc['cached_tokens']} of {tok['total']} input tokens served from cache"),
        ("", f"assumes {pc['assumption']}"),
        ("output tokens", f"0 .. {est.max_output_tokens} (each row's max_tokens, capped to the context{_n(spec)})"),
        ("input cost", money_display(c["input"]) + _discounted(c["input_with_cache"])),
        ("output cost", f"{money_display(c['output_min'])} .. {money_display(c['output_max'])}"),
        ("total cost", f"{money_display(c['total_min'])} .. {money_display(c['total_max'])}"),
    ]
    lines += [("example error", e) for e in est.error_examples]
    if not prices.any_set:
        lines.append(("", "no prices: add a pricing section to the job or give --price-input/--price-output"))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines) + "\n"
