"""The report as ONE self-contained HTML page: inline CSS, the tables, and inline SVG charts
(input and output token-length histograms, cost or tokens by group). No scripts, no external assets.
"""

from __future__ import annotations

from decimal import Decimal
from html import escape
from pathlib import Path
from typing import Any

import numpy as np

from batchgen.errors import OutputError
from batchgen.outputs.totals import IntHistogram
from batchgen.usage.pricing import Prices, money_display
from batchgen.usage.render import records
from batchgen.usage.report import Report

MAX_BINS = 40
_TOTAL_ROW = ' class="total"'
CHART_W, CHART_H = 640, 180
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.4em}h2{font-size:1.1em;margin-top:2em}
table{border-collapse:collapse;margin:.5em 0}th,td{border:1px solid #ccc;padding:3px 8px}
td.n{text-align:right;font-variant-numeric:tabular-nums}tr.total{font-weight:bold;background:#f3f3f3}
.bad{color:#b00;font-weight:bold}.note{color:#666}svg text{font-size:11px;fill:#333}
rect.bar{fill:#4a7fb5}
"""
_COLUMNS = [
    ("group", "group"),
    ("rows", "rows"),
    ("ok_rows", "ok"),
    ("error_rows", "errors"),
    ("input_tokens", "input tokens"),
    ("cached_tokens", "cached tokens"),
    ("output_tokens", "output tokens"),
    ("output_tokens_mean", "output mean"),
    ("output_tokens_p95", "output p95"),
    ("input_cost", "input cost"),
    ("output_cost", "output cost"),
    ("cost", "cost"),
]


def render_html(report: Report, prices: Prices) -> str:
    rows = records(report, prices)
    status_class = "bad" if report.status.mismatches else "note"
    title = f"batchgen report: {report.path}"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="{status_class}">{escape(report.status.line())}</p>',
        f'<p class="note">prices per million tokens: {escape(_prices_text(prices))}; '
        "p95 is the exact nearest-rank value over rows that did not fail</p>",
        "<h2>Usage and cost" + (f" by {escape(report.by)}" if report.by else "") + "</h2>",
        _usage_table(rows),
        "<h2>Row outcomes</h2>",
        _outcome_table(rows),
        "<h2>Input token lengths</h2>",
        histogram_svg(report.totals.input_lengths, "input tokens per row"),
        "<h2>Output token lengths</h2>",
        histogram_svg(report.totals.output_lengths, "output tokens per row"),
    ]
    if report.by:
        what = "Cost" if prices.any_set else "Tokens"
        body += [f"<h2>{what} by {escape(report.by)}</h2>", _group_chart(rows[1:], prices)]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def write_html(report: Report, prices: Prices, path: str | Path) -> Path:
    path = Path(path)
    try:
        path.write_text(render_html(report, prices), encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"--html {path}: cannot write the page: {exc.strerror or exc}") from exc
    return path


def _prices_text(prices: Prices) -> str:
    if not prices.any_set:
        return "none given"
    cached = "at the input price" if prices.cached_input is None else prices.cached_input
    parts = [("input", _or_dash(prices.input)), ("cached input", cached), ("output", _or_dash(prices.output))]
    apart = [name for name, _ in prices.adapters]  # pricing.lora
    text = ", ".join(f"{name} {value}" for name, value in parts)
    return text + (f"; LoRA adapters priced apart: {', '.join(apart)}" if apart else "")


def _or_dash(value: Decimal | None) -> str:
    return "-" if value is None else str(value)


def _usage_table(rows: list[dict[str, Any]]) -> str:
    columns = list(_COLUMNS)
    if rows and "reasoning_tokens" in rows[0]:  # output.reasoning auto: the output tokens spent thinking
        columns.insert(columns.index(("output_tokens", "output tokens")) + 1, ("reasoning_tokens", "reasoning tokens"))
    head = "".join(f"<th>{escape(label)}</th>" for _, label in columns)
    lines = [f"<table><tr>{head}</tr>"]
    for i, row in enumerate(rows):
        cells = []
        for key, _ in columns:
            value = row[key]
            text = money_display(value) if key.endswith("cost") else ("-" if value is None else str(value))
            cells.append(f"<td>{escape(text)}</td>" if key == "group" else f'<td class="n">{escape(text)}</td>')
        lines.append(f"<tr{_TOTAL_ROW if i == 0 else ''}>{''.join(cells)}</tr>")
    return "\n".join(lines + ["</table>"])


def _outcome_table(rows: list[dict[str, Any]]) -> str:
    reasons = sorted({k for r in rows for k in r["finish_reasons"]})
    codes = sorted({k for r in rows for k in r["error_codes"]})
    head = "<th>group</th>" + "".join(f"<th>finish: {escape(k)}</th>" for k in reasons)
    head += "".join(f"<th>error: {escape(k)}</th>" for k in codes)
    lines = [f"<table><tr>{head}</tr>"]
    for i, row in enumerate(rows):
        counts = [row["finish_reasons"].get(k, 0) for k in reasons] + [row["error_codes"].get(k, 0) for k in codes]
        cells = "".join(f'<td class="n">{c}</td>' for c in counts)
        lines.append(f"<tr{_TOTAL_ROW if i == 0 else ''}><td>{escape(row['group'])}</td>{cells}</tr>")
    return "\n".join(lines + ["</table>"])


def _bins(hist: IntHistogram) -> list[tuple[int, int, int]]:
    """(low, high, rows) for at most MAX_BINS equal-width integer bins from the min to the max."""
    low, high = int(hist.values[0]), int(hist.values[-1])
    width = max(1, -(-(high - low + 1) // MAX_BINS))
    rows = np.zeros((high - low) // width + 1, np.int64)
    np.add.at(rows, (hist.values - low) // width, hist.counts)
    return [(low + i * width, low + (i + 1) * width - 1, int(c)) for i, c in enumerate(rows)]


def histogram_svg(hist: IntHistogram, label: str) -> str:
    """A bar chart of rows per length bin; each bar's tooltip gives its range and count."""
    if not hist.n:
        return '<p class="note">no rows</p>'
    bins = _bins(hist)
    peak = max(c for _, _, c in bins)
    plot_h, bar_w = CHART_H - 30, CHART_W / len(bins)
    bars = []
    for i, (low, high, count) in enumerate(bins):
        h = plot_h * count / peak
        span = str(low) if low == high else f"{low}-{high}"
        bars.append(
            f'<rect class="bar" x="{i * bar_w:.1f}" y="{plot_h - h:.1f}" width="{max(bar_w - 1, 1):.1f}" '
            f'height="{h:.1f}"><title>{span} tokens: {count} rows</title></rect>'
        )
    axis = (
        f'<text x="0" y="{plot_h + 14}">{bins[0][0]}</text>'
        f'<text x="{CHART_W}" y="{plot_h + 14}" text-anchor="end">{bins[-1][1]}</text>'
        f'<text x="{CHART_W / 2}" y="{plot_h + 26}" text-anchor="middle">'
        f"{escape(label)}; tallest bar {peak} rows</text>"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{CHART_H}" '
        f'role="img" aria-label="{escape(label)}">{"".join(bars)}{axis}</svg>'
    )


def _group_chart(rows: list[dict[str, Any]], prices: Prices) -> str:
    """Horizontal bars per group: its cost when prices are known, else its input + output tokens."""
    use_cost = prices.any_set and all(r["cost"] is not None for r in rows)
    values = [(r["group"], r["cost"] if use_cost else Decimal(r["input_tokens"] + r["output_tokens"])) for r in rows]
    if not values:
        return '<p class="note">no groups</p>'
    peak = max((v for _, v in values), default=Decimal(0)) or Decimal(1)
    label_w, row_h = 160, 20
    plot_w = CHART_W - label_w - 110
    items = []
    for i, (name, value) in enumerate(values):
        y, w = i * row_h, float(value / peak) * plot_w
        shown = money_display(value) if use_cost else f"{value} tokens"
        items.append(
            f'<text x="{label_w - 6}" y="{y + 14}" text-anchor="end">{escape(name[:24])}</text>'
            f'<rect class="bar" x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}">'
            f"<title>{escape(name)}: {escape(shown)}</title></rect>"
            f'<text x="{label_w + w + 4:.1f}" y="{y + 14}">{escape(shown)}</text>'
        )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_W}" height="{row_h * len(values) + 4}" '
        f'role="img" aria-label="by group">{"".join(items)}</svg>'
    )
