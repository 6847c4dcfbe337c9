"""LoRA adapters in the job's bookkeeping, without running the engine: per-adapter totals from
parts, `report --by lora` and `pricing.lora` on a written output, the window order (each adapter's
rows together), the prefix plan (rows keyed by adapter, prompt blocks hashed under its content
hash) and estimate's replay (no prefix shared across adapters)."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.core.block_hash import chain_block_hashes
from batchgen.engine.core.sequence import RequestExtras
from batchgen.inputs.grouping import adapter_key, prompt_key
from batchgen.inputs.ordering import order_requests
from batchgen.job.sections import PricingSection
from batchgen.outputs.adapter_field import adapter_field
from batchgen.outputs.completion import build_manifest
from batchgen.outputs.totals import Totals
from batchgen.usage.estimate import prefix_cache_hits
from batchgen.usage.pricing import Prices

ROWS = {
    "lora": ["a", None, "b", "a", None, "zz"],
    "input_tokens": [10, 20, 30, 40, 50, 0],
    "cached_tokens": [0, 16, 0, 16, 0, 0],
    "output_tokens": [5, 6, 7, 8, 9, 0],
    "error_code": [None, None, None, None, None, "unknown_adapter"],
    "finish_reason": ["stop", "length", "stop", "stop", "length", "error"],
}


def _part(folder: Path, index: int, rows: slice, old: bool = False) -> None:
    """`old`: as the release before the adapter column's mark wrote it (unmarked)."""
    columns = {k: v[rows] for k, v in ROWS.items()}
    n = len(columns["lora"])
    table = pa.table(
        {
            "id": [f"r{index}-{i}" for i in range(n)],
            "generated_text": ["x"] * n,
            "finish_reason": columns["finish_reason"],
            "stop_reason": pa.array([None] * n, pa.string()),
            "input_tokens": pa.array(columns["input_tokens"], pa.int64()),
            "cached_tokens": pa.array(columns["cached_tokens"], pa.int64()),
            "output_tokens": pa.array(columns["output_tokens"], pa.int64()),
            "error_code": pa.array(columns["error_code"], pa.string()),
            "error_message": pa.array([None] * n, pa.string()),
            "lora": pa.array(columns["lora"], pa.string()),
        },
        schema=None if old else pa.schema([*(pa.field(n, t) for n, t in BASE_TYPES), adapter_field()]),
    )
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / f"part-{index:06d}.parquet")


@pytest.fixture()
def output(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    _part(out, 0, slice(0, 3))
    _part(out, 1, slice(3, 6))
    return out


BASE_TYPES = [
    ("id", pa.string()),
    ("generated_text", pa.string()),
    ("finish_reason", pa.string()),
    ("stop_reason", pa.string()),
    ("input_tokens", pa.int64()),
    ("cached_tokens", pa.int64()),
    ("output_tokens", pa.int64()),
    ("error_code", pa.string()),
    ("error_message", pa.string()),
]


def _expected() -> dict[str, dict[str, int]]:
    return {
        "a": {"rows": 2, "ok": 2, "input": 50, "cached": 16, "output": 13},
        "b": {"rows": 1, "ok": 1, "input": 30, "cached": 0, "output": 7},
        "(base)": {"rows": 2, "ok": 2, "input": 70, "cached": 16, "output": 15},
        "zz": {"rows": 1, "ok": 0, "input": 0, "cached": 0, "output": 0},
    }


def test_totals_count_rows_and_tokens_per_adapter() -> None:
    whole, halves = Totals(), [Totals(), Totals()]
    whole.add_part(dict(ROWS), "lora")
    halves[0].add_part({k: v[:3] for k, v in ROWS.items()}, "lora")
    halves[1].add_part({k: v[3:] for k, v in ROWS.items()}, "lora")
    halves[0].merge(halves[1])
    assert whole.by_lora == halves[0].by_lora == _expected()
    record = {"id": "x", "run": {"parts": 2, "inputs": [], "backend": "native", "started": 0.0}}
    assert build_manifest(whole, record, 0.0, 1.0, 45)["lora"] == _expected()
    plain = Totals()
    plain.add_part(dict(ROWS))  # a column named `lora` is not batchgen's adapter column unless the caller says so
    assert "lora" not in build_manifest(plain, record, 0.0, 1.0, 45)  # a job without adapters: as before


def test_report_by_lora_and_the_manifest_check(output: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(output), "--by", "lora", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    groups = {g["group"]: g for g in [body["totals"], *body["groups"]]}
    assert {k: (g["rows"], g["input_tokens"], g["output_tokens"]) for k, g in groups.items()} == {
        "(total)": (6, 150, 35),
        "(base)": (2, 70, 15),  # the base model's rows, named as _SUCCESS names them
        "a": (2, 50, 13),
        "b": (1, 30, 7),
        "zz": (1, 0, 0),  # an unknown adapter's error row, under the name it asked for
    }
    assert groups["zz"]["error_rows"] == 1
    totals = Totals()
    totals.add_part(dict(ROWS), "lora")
    record = {"id": "x", "run": {"parts": 2, "inputs": [], "backend": "native", "started": 0.0}}
    manifest = build_manifest(totals, record, 0.0, 1.0, 35)
    (output / "_SUCCESS").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["report", str(output), "--by", "lora", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    by_group = {g["group"]: (g["rows"], g["ok_rows"], g["input_tokens"]) for g in body["groups"]}
    assert by_group == {k: (v["rows"], v["ok"], v["input"]) for k, v in manifest["lora"].items()}  # one vocabulary
    table = CliRunner().invoke(main, ["report", str(output), "--by", "lora"])
    assert "(base)" in table.output and "(null)" not in table.output
    manifest["lora"]["a"]["output"] += 1  # a _SUCCESS whose per-adapter figures the parts do not hold
    (output / "_SUCCESS").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["report", str(output)])
    assert result.exit_code == 3 and "lora: _SUCCESS says" in result.output


def test_pricing_lora_prices_each_adapter_apart_in_every_group(output: Path, tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: {path: m}\ninput: {path: i.parquet}\noutput: {path: o}\n"
        "pricing: {input: 1, output: 2, lora: {a: {output: 10}, b: {input: 3, cached_input: 0}}}\n"
    )
    result = CliRunner().invoke(main, ["report", str(output), "--by", "lora", "--job", str(job), "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    groups = {g["group"]: g for g in [body["totals"], *body["groups"]]}
    million = Decimal(1_000_000)
    # a: input 50 at 1, output 13 at 10; b: input 30 at 3; base: 70 at 1, 15 at 2; zz: nothing
    assert Decimal(groups["a"]["cost"]) == (50 * 1 + 13 * 10) / million
    assert Decimal(groups["b"]["cost"]) == (30 * 3 + 7 * 2) / million
    assert Decimal(groups["(base)"]["cost"]) == (70 * 1 + 15 * 2) / million
    parts = sum(Decimal(g["cost"]) for name, g in groups.items() if name != "(total)")
    assert Decimal(groups["(total)"]["cost"]) == parts  # group costs add up to the total
    result = CliRunner().invoke(main, ["report", str(output), "--job", str(job), "--json"])  # no --by: the same total
    assert Decimal(json.loads(result.output)["totals"]["cost"]) == parts


def test_prices_for_an_adapter_fall_back_to_the_jobs() -> None:
    section = PricingSection.model_validate({"input": "1", "output": "2", "lora": {"a": {"output": "5"}}})
    prices = Prices.from_section(section)
    assert prices.for_adapter("a") == Prices(Decimal(1), None, Decimal(5))
    assert prices.for_adapter("other") == Prices(Decimal(1), None, Decimal(2))
    assert prices.as_json()["lora"]["a"]["output"] == "5"


def test_each_adapters_rows_are_ordered_together() -> None:
    prompts = [[5, 1], [1, 2, 3], [5, 1, 2], [1, 2], [9], [1, 2, 3, 4]]
    adapters = ["b", None, "a", "b", None, "a"]
    for strategy in ("prefix", "length"):
        order = order_requests(prompts, strategy, adapters)  # type: ignore[arg-type]
        assert sorted(order) == list(range(6))
        runs = [adapters[i] for i in order]
        assert runs == [None, None, "a", "a", "b", "b"]  # the base model first, then by name
    assert order_requests(prompts, "none", adapters) == list(range(6))  # none: input order, as asked


def test_plan_keys_start_with_the_adapter_and_hash_blocks_under_it() -> None:
    hashes = {"a": b"A" * 32, "b": b"B" * 32}
    ids = list(range(40))
    base_head, base_extras = adapter_key(None, hashes)
    a_head, a_extras = adapter_key("a", hashes)
    assert base_head == bytes(8) and a_head != adapter_key("b", hashes)[0]
    base, under_a = prompt_key(ids, 16, extras=base_extras), prompt_key(ids, 16, extras=a_extras)
    assert base == prompt_key(ids, 16)  # the base model's keys are the text-only keys of old
    assert under_a != base
    expected = chain_block_hashes(ids, 16, 2, [], RequestExtras(adapter_hash=hashes["a"]))
    assert under_a == b"".join(h[:8] for h in expected)  # what the engine's prefix cache means


def test_estimate_shares_no_prefix_across_adapters() -> None:
    prompt = list(range(48))
    each: list[int] = []
    hits = prefix_cache_hits([prompt, prompt, prompt], 16, None, [-1, ("lora", "a"), ("lora", "a")], each)
    assert each == [0, 0, 32] and hits == 32  # the second is under another adapter: computed anew


def test_the_prefix_plan_runs_each_adapters_rows_together(tmp_path: Path) -> None:
    from batchgen.job.spec import load_job
    from batchgen.run.layout import make_cut
    from batchgen.run.validate import validate_inputs
    from tests.conftest import write_job, write_parquet

    repo = Path(__file__).resolve().parent.parent
    docs = [" ".join(f"story {d} line {i}." for i in range(40)) for d in range(3)]
    names = ["storyteller", "terse", None, ""]
    prompts = [f"{docs[i % 3]} Question {i}?" for i in range(24)]
    adapter = [names[i % 4] for i in range(24)]
    write_parquet(tmp_path / "in.parquet", {"id": [f"r{i}" for i in range(24)], "prompt": prompts, "adapter": adapter})
    lora = {n: str(repo / "sample_data" / "lora" / n) for n in ("storyteller", "terse")}
    job = {
        "model": {"path": str(repo / "sample_data" / "demo-model"), "lora": lora},
        "input": {"path": str(tmp_path / "in.parquet"), "id_column": "id", "lora_column": "adapter"},
        "output": {"path": str(tmp_path / "out")},
        "engine": {"backend": "native", "window_rows": 5},
    }
    spec = load_job(write_job(tmp_path / "job.yaml", job))
    cut = make_cut(spec, validate_inputs(spec))
    order = [adapter[r] or None for r in cut.rows.tolist()]
    assert sorted(cut.rows.tolist()) == list(range(24))
    runs = [a for i, a in enumerate(order) if i == 0 or order[i - 1] != a]
    assert sorted(runs, key=str) == sorted([None, "storyteller", "terse"], key=str)  # one run per adapter
    for name in (None, "storyteller", "terse"):  # within an adapter, each document's rows together
        docs_in_order = [cut.rows[i] % 3 for i, a in enumerate(order) if a == name]
        assert len([d for i, d in enumerate(docs_in_order) if i == 0 or docs_in_order[i - 1] != d]) == len(
            set(docs_in_order)
        )
