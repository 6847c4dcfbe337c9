"""Render throughput.py's JSON as the markdown table in benchmarks/RESULTS.md (between markers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _row(model: str, workload: str, system: str, f: dict[str, Any]) -> str:
    cells = [
        model,
        workload,
        system,
        f"{f['output_tok_s']:.0f}",
        f"{f['total_tok_s']:.0f}",
        f"{f['seconds']:.1f}",
        str(f["prefill_tokens"] if f["prefill_tokens"] is not None else "n/a"),
        str(f["preemptions"] if f["preemptions"] is not None else "n/a"),
        f"{f['peak_rss_mib']:.0f}",
        "n/a" if f.get("cpu_wait_share") is None else f"{f['cpu_wait_share']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def systems_table(report: dict[str, Any]) -> list[str]:
    lines = [
        "| model | workload | system | output tok/s | total tok/s | seconds | prefill tokens | preemptions "
        "| peak RSS MiB | CPU wait |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, res in report["models"].items():
        for workload, w in res["workloads"].items():
            for system, f in w.get("systems", {}).items():
                lines.append(_row(model, workload, system, f))
    return lines


def ratios_table(report: dict[str, Any]) -> list[str]:
    lines = ["| target | measured | met |", "|---|---:|---|"]
    lines += [f"| {t['target']} | {t['measured']:.2f} | {'yes' if t['met'] else 'NO'} |" for t in report["targets"]]
    return lines


def other_lines(report: dict[str, Any]) -> list[str]:
    """Greedy agreement, the decode step breakdown, and workloads that were skipped."""
    lines: list[str] = []
    for model, res in report["models"].items():
        for workload, w in res["workloads"].items():
            if "skipped" in w:
                lines.append(f"- {model} {workload}: skipped ({w['skipped']})")
            for a in w.get("greedy_agreement", []):
                lines.append(
                    f"- {model} {workload} greedy agreement with {a['against']}: {a['identical_requests']}"
                    f"/{a['requests']} requests identical, {a['leading_tokens_matching']:.1%} of tokens "
                    "before the first difference"
                )
        for workload, w in res["workloads"].items():
            for system, f in w.get("systems", {}).items():
                if f.get("compile_seconds"):
                    lines.append(
                        f"- {model} {workload} {system}: compiled in {f['compile_seconds']:.1f} s during the warm-up "
                        f"({f['compiled_graphs']} graphs, {f.get('compiled_graphs_in_run', 0)} more in the timed "
                        "run), not in its time"
                    )
            for key, value in w.get("ratios", {}).items():
                if key.startswith(("compiled_", "bf16_")):
                    lines.append(f"- {model} {workload} {key}: {value:.2f}")
        d = res["decode_step"]
        parts = ", ".join(f"{k} {v:.1f}" for k, v in d["breakdown_ms"].items())
        lines.append(
            f"- {model} decode step ({d['batch']} seqs x {d['context']} context): raw forward "
            f"{d['raw_forward_ms']:.1f} ms, engine execute {d['native_execute_ms']:.1f} ms, engine step "
            f"{d['native_step_ms']:.1f} ms; breakdown (ms/step): {parts}"
        )
    return lines


def render(report: dict[str, Any]) -> str:
    m = report["machine"]
    head = [
        f"Measured {report['date']} with `.venv/bin/python {report['command']}` "
        f"({report['requests']} requests per workload, {report['wall_seconds']:.0f} s wall).",
        f"Machine: {m['cores']} cores ({m['cpu']}), torch {m['torch']} with {m['torch_threads']} threads, "
        f"transformers {m['transformers']}, GPU: {m['gpu'] or 'none'}.",
        "",
    ]
    models = [
        f"- {name}: {res['description']}, {res['params'] / 1e6:.1f}M parameters"
        for name, res in report["models"].items()
    ]
    body = head + models + ["", *ratios_table(report), "", *systems_table(report), "", *other_lines(report)]
    return "\n".join(body)


def update(report: dict[str, Any], path: Path = RESULTS) -> None:
    """Replace the text between the markers (or append a marked section if there is none)."""
    block = f"{START}\n{render(report)}\n{END}"
    text = path.read_text() if path.exists() else "# Throughput results\n\n"
    if START in text and END in text:
        before, rest = text.split(START, 1)
        text = before + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
