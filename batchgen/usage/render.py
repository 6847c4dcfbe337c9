"""Lays a Report out for people and programs: per-group records with exact Decimal costs, JSON,
CSV and an aligned terminal table."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from batchgen.usage.pricing import (
    Prices,
    adapter_costs,
    add_costs,
    input_cost,
    money_display,
    money_text,
    output_cost,
)
from batchgen.usage.report import GroupStats, Report


def record(
    name: str, stats: GroupStats, prices: Prices, per_sample: bool = False, reasoning: bool = False
) -> dict[str, Any]:
    """One group's (or the totals') figures; money as exact Decimal. `per_sample` (a job with
    n > 1): a `samples` figure, and finish reasons and output lengths count samples. `reasoning`
    (output.reasoning auto): `reasoning_tokens`, the part of output_tokens spent thinking."""
    if prices.adapters and stats.by_lora:  # adapters priced apart (pricing.lora): each at its own prices
        in_cost, out_cost = adapter_costs(prices, stats.by_lora)
    else:
        in_cost = input_cost(prices, stats.input_tokens, stats.cached_tokens)
        out_cost = output_cost(prices, stats.output_tokens)
    mean = stats.output_lengths.mean()
    return (
        {
            "group": name,
            "rows": stats.rows,
            "ok_rows": stats.ok_rows,
            "error_rows": stats.error_rows,
            "error_codes": dict(sorted(stats.error_codes.items())),
            "input_tokens": stats.input_tokens,
            "cached_tokens": stats.cached_tokens,
            "output_tokens": stats.output_tokens,
            "finish_reasons": dict(sorted(stats.finish_reasons.items())),
            "output_tokens_mean": None if mean is None else round(mean, 2),
            "output_tokens_p95": stats.output_lengths.percentile(95),
            "input_tokens_p95": stats.input_lengths.percentile(95),
            "input_cost": in_cost,
            "output_cost": out_cost,
            "cost": add_costs(in_cost, out_cost),
        }
        | ({"samples": stats.samples} if per_sample else {})
        | ({"reasoning_tokens": stats.reasoning_tokens} if reasoning else {})
    )


def records(report: Report, prices: Prices) -> list[dict[str, Any]]:
    """The totals first (group "(total)"), then one record per group."""
    per, thinking = report.per_sample, report.reasoning
    groups = [record(n, s, prices, per, thinking) for n, s in report.groups.items()]
    return [record("(total)", report.totals, prices, per, thinking), *groups]


def to_json(report: Report, prices: Prices) -> str:
    rows = [{k: money_text(v) if k.endswith("cost") else v for k, v in r.items()} for r in records(report, prices)]
    body = {
        "path": str(report.path),
        "by": report.by,
        "status": report.status.line(),
        "finished": report.status.finished,
        "parts": report.status.parts,
        "mismatches": report.status.mismatches,
        "prices": prices.as_json(),
        "p95": "nearest rank, exact",
        "totals": rows[0],
        "groups": rows[1:],
    }
    return json.dumps(body, indent=2) + "\n"  # why: text output ends with a newline, as to_text and to_csv


def to_csv(report: Report, prices: Prices) -> str:
    """One row per group after the totals row; finish reasons and error codes become columns."""
    rows = records(report, prices)
    reasons = sorted({k for r in rows for k in r["finish_reasons"]})
    codes = sorted({k for r in rows for k in r["error_codes"]})
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    plain = [k for k in rows[0] if k not in ("finish_reasons", "error_codes")]
    writer.writerow(plain + [f"finish_reason.{k}" for k in reasons] + [f"error_code.{k}" for k in codes])
    for r in rows:
        counts = [r["finish_reasons"].get(k, 0) for k in reasons] + [r["error_codes"].get(k, 0) for k in codes]
        writer.writerow([money_text(r[k]) if k.endswith("cost") else r[k] for k in plain] + counts)
    return buf.getvalue()


def to_text(report: Report, prices: Prices) -> str:
    """An aligned terminal table with a status line and, when prices are missing, a hint."""
    head = [
        "group",
        "rows",
        "ok",
        "errors",
        "input",
        "cached",
        "output",
        *(["reasoning"] if report.reasoning else []),
        "out mean",
        "out p95",
        "cost",
        "finish / errors",
    ]
    table = [head]
    for r in records(report, prices):
        mix = " ".join(f"{k}:{v}" for k, v in [*r["finish_reasons"].items(), *r["error_codes"].items()])
        table.append(
            [
                r["group"],
                r["rows"],
                r["ok_rows"],
                r["error_rows"],
                r["input_tokens"],
                r["cached_tokens"],
                r["output_tokens"],
                *([r["reasoning_tokens"]] if report.reasoning else []),
                r["output_tokens_mean"],
                r["output_tokens_p95"],
                money_display(r["cost"]),
                mix,
            ]
        )
    cells = [["-" if v is None else str(v) for v in row] for row in table]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    left = (0, len(head) - 1)
    lines = [
        "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
        for row in cells
    ]
    notes = [f"{report.path}: {report.status.line()}"]
    if report.per_sample:
        samples = report.totals.samples
        notes.append(f"{samples} samples in {report.totals.rows} rows: finish reasons and out mean/p95 are per sample")
    if not prices.any_set:
        notes.append(
            "no prices: give --job JOB (its pricing section) or --price-input/--price-cached-input/--price-output"
        )
    return "\n".join(notes + lines) + "\n"
