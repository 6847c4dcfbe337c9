"""`batchgen report` on outputs of real job runs (tiny model, hf backend): exact totals against
pyarrow column sums, groups, Decimal costs, CSV/JSON/HTML, in-progress folders, _SUCCESS checks."""

from __future__ import annotations

import csv
import io
import json
import math
import shutil
from decimal import Decimal
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.usage.pricing import money_text
from tests.conftest import make_job, write_job, write_parquet

WORDS = "once upon a time there was a little cat who liked to play in the sun with her friend dog".split()
CATEGORIES = ["animals", "sun", "time"]
PRICES = {"input": "0.15", "cached_input": "0.075", "output": "0.6"}


@pytest.fixture(scope="module")
def output(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """A finished run of 24 rows in 3 parts, 3 categories, with 4 error rows of 3 kinds."""
    tmp = tmp_path_factory.mktemp("report")
    prompts: list[str | None] = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(2 + i % 9)) for i in range(24)]
    prompts[3], prompts[10], prompts[17] = None, "   ", "the cat " * 200
    max_tokens = [2 + i % 7 for i in range(24)]
    max_tokens[21] = -1
    write_parquet(
        tmp / "in.parquet",
        {
            "id": [f"r{i}" for i in range(24)],
            "prompt": prompts,
            "category": [CATEGORIES[i % 3] for i in range(24)],
            "mt": max_tokens,
        },
    )
    job = make_job(
        tiny_model_dir,
        str(tmp / "in.parquet"),
        tmp / "out",
        engine={"window_rows": 8},
        input={"sampling_columns": {"max_tokens": "mt"}},
    )
    job["pricing"] = dict(PRICES)
    result = CliRunner().invoke(main, ["run", str(write_job(tmp / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output
    return tmp / "out"


def _report(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["report", *args])
    return result.exit_code, result.stdout, result.stderr


def _prices() -> list[str]:
    return [
        "--price-input",
        PRICES["input"],
        "--price-cached-input",
        PRICES["cached_input"],
        "--price-output",
        PRICES["output"],
    ]


def test_totals_and_groups_equal_the_column_sums(output: Path) -> None:
    code, out, err = _report(str(output), "--by", "category", "--json", *_prices())
    assert code == 0, err
    body = json.loads(out)
    table = ds.dataset(output).to_table()
    totals = body["totals"]
    for column in ("input_tokens", "cached_tokens", "output_tokens"):
        assert totals[column] == pc.sum(table.column(column)).as_py()
        assert sum(g[column] for g in body["groups"]) == totals[column]
    codes = table.column("error_code").to_pylist()
    assert totals["rows"] == table.num_rows == 24 and totals["ok_rows"] == 20 and totals["error_rows"] == 4
    assert totals["error_codes"] == {"empty_prompt": 2, "invalid_sampling": 1, "prompt_too_long": 1}
    assert totals["finish_reasons"] == {
        r: table.column("finish_reason").to_pylist().count(r) for r in set(table.column("finish_reason").to_pylist())
    }
    assert [g["group"] for g in body["groups"]] == CATEGORIES
    for group in body["groups"]:
        rows = [r for r in table.to_pylist() if r["category"] == group["group"]]
        assert group["rows"] == len(rows) and group["error_rows"] == sum(r["error_code"] is not None for r in rows)
        lengths = sorted(r["output_tokens"] for r in rows if r["error_code"] is None)
        assert group["output_tokens_p95"] == lengths[math.ceil(0.95 * len(lengths)) - 1]
        assert group["output_tokens_mean"] == round(sum(lengths) / len(lengths), 2)
    assert sum(g["rows"] for g in body["groups"]) == 24 and codes.count(None) == 20
    assert body["finished"] and body["mismatches"] == [] and "totals match _SUCCESS" in body["status"]


def test_json_ends_with_one_newline(output: Path) -> None:
    code, out, err = _report(str(output), "--json")
    assert code == 0, err
    assert out.endswith("}\n") and not out.endswith("\n\n")  # as a shell prompt and `jq` expect


def test_costs_are_exact_decimals_and_groups_sum_to_the_total(output: Path) -> None:
    code, out, err = _report(str(output), "--by", "category", "--json", *_prices())
    assert code == 0, err
    body = json.loads(out)
    t = body["totals"]
    price = {k: Decimal(v) for k, v in PRICES.items()}
    expected_in = (
        Decimal(t["input_tokens"] - t["cached_tokens"]) * price["input"]
        + Decimal(t["cached_tokens"]) * price["cached_input"]
    ) / 1_000_000
    expected_out = Decimal(t["output_tokens"]) * price["output"] / 1_000_000
    assert Decimal(t["input_cost"]) == expected_in and Decimal(t["output_cost"]) == expected_out
    assert t["cost"] == money_text(expected_in + expected_out)
    assert sum(Decimal(g["cost"]) for g in body["groups"]) == Decimal(t["cost"])
    # The job file's pricing section gives the same figures as the flags.
    code, from_job, err = _report(str(output), "--by", "category", "--json", "--job", str(output.parent / "job.yaml"))
    assert code == 0, err
    assert json.loads(from_job)["totals"]["cost"] == t["cost"]
    code, no_prices, _ = _report(str(output), "--json")
    assert json.loads(no_prices)["totals"]["cost"] is None


def test_csv_and_text_tables(output: Path) -> None:
    code, out, err = _report(str(output), "--by", "category", "--csv", *_prices())
    assert code == 0, err
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["group"] for r in rows] == ["(total)", *CATEGORIES]
    assert sum(int(r["input_tokens"]) for r in rows[1:]) == int(rows[0]["input_tokens"])
    assert sum(Decimal(r["cost"]) for r in rows[1:]) == Decimal(rows[0]["cost"])
    assert int(rows[0]["error_code.empty_prompt"]) == 2
    assert sum(int(rows[0][k]) for k in rows[0] if k.startswith("finish_reason.")) == 24
    code, text, _ = _report(str(output), "--by", "category")
    assert code == 0
    assert "totals match _SUCCESS" in text and "no prices" in text
    assert all(name in text for name in CATEGORIES)


def test_html_is_one_self_contained_page(output: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    code, out, err = _report(str(output), "--by", "category", "--html", str(page), *_prices())
    assert code == 0, err
    assert str(page) in out
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.count("<svg") == 3
    assert all(name in html for name in CATEGORIES)
    for external in ("<script", "<link", "src=", "href=", "@import", "url("):
        assert external not in html
    assert _report(str(output), "--csv", "--json")[0] == 2  # one format at a time


def test_a_run_in_progress_reports_its_committed_parts(output: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    for name in ("part-000000.parquet", "part-000001.parquet"):
        shutil.copy(output / name, partial / name)
    (partial / ".part-000002.parquet.0123abcd.tmp").write_bytes(b"half a part")
    code, out, err = _report(str(partial), "--json")
    assert code == 0, err
    body = json.loads(out)
    assert body["status"] == "in progress: 2 parts committed, no _SUCCESS" and not body["finished"]
    committed = ds.dataset([str(partial / "part-000000.parquet"), str(partial / "part-000001.parquet")]).to_table()
    assert body["totals"]["rows"] == committed.num_rows == 16
    assert body["totals"]["output_tokens"] == pc.sum(committed.column("output_tokens")).as_py()


def test_a_manifest_mismatch_is_loud(output: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(output, copy)
    manifest = json.loads((copy / "_SUCCESS").read_text())
    manifest["tokens"]["input"] += 1
    (copy / "_SUCCESS").write_text(json.dumps(manifest))
    code, out, err = _report(str(copy))
    assert code == 3
    assert "DISAGREE" in out and "tokens.input: _SUCCESS says" in err
    (copy / "part-000002.parquet").unlink()
    code, out, err = _report(str(copy), "--json")
    assert code == 3 and "rows.total" in " ".join(json.loads(out)["mismatches"])


def test_clear_errors(output: Path, tmp_path: Path) -> None:
    code, _, err = _report(str(output), "--by", "nope")
    assert code == 3 and "--by 'nope'" in err and "category" in err
    (tmp_path / "empty").mkdir()
    code, _, err = _report(str(tmp_path / "empty"))
    assert code == 3 and "no committed part-*.parquet" in err
    code, _, err = _report(str(tmp_path / "missing"))
    assert code == 3 and "no such output folder" in err
    code, _, err = _report(str(output), "--price-input", "-1")
    assert code == 2 and "--price-input" in err
    foreign = ds.dataset(output).to_table().drop_columns(["cached_tokens"])
    pq.write_table(foreign, tmp_path / "empty" / "part-000000.parquet")
    code, _, err = _report(str(tmp_path / "empty"))
    assert code == 3 and "not a batchgen output" in err


def test_histograms_and_null_or_dictionary_groups_on_a_written_part(tmp_path: Path) -> None:
    import pyarrow as pa

    from batchgen.outputs.totals import IntHistogram
    from batchgen.usage.report import read_report

    hist = IntHistogram()
    hist.add_many(np.array([5, 1, 3, 3]))
    hist.merge(hist)
    assert (hist.n, hist.max(), hist.mean(), hist.percentile(50), hist.percentile(95)) == (8, 5, 3.0, 3, 5)
    category = pa.array(["a", None, "b", "a", None, "b"]).dictionary_encode()
    table = pa.table(
        {
            "category": category,
            "finish_reason": ["stop", "length", "error", "stop", "stop", "length"],
            "error_code": [None, None, "empty_prompt", None, None, None],
            "input_tokens": [3, 4, 0, 5, 6, 7],
            "cached_tokens": [0, 2, 0, 3, 0, 0],
            "output_tokens": [1, 2, 0, 3, 4, 5],
        }
    )
    pq.write_table(table, tmp_path / "part-000000.parquet")
    report = read_report(tmp_path, "category")
    assert list(report.groups) == ["(null)", "a", "b"]
    assert [g.rows for g in report.groups.values()] == [2, 2, 2]
    assert report.groups["b"].error_codes == {"empty_prompt": 1} and report.groups["b"].output_lengths.n == 1
    assert report.groups["(null)"].output_lengths.percentile(95) == 4 and report.totals.cached_tokens == 5


def test_groups_of_a_numeric_column_sort_as_numbers(output: Path) -> None:
    code, out, err = _report(str(output), "--by", "input_tokens", "--json")
    assert code == 0, err
    names = [g["group"] for g in json.loads(out)["groups"]]
    assert len(names) > 3 and any(len(n) > 1 for n in names) and any(len(n) == 1 for n in names)
    assert names == [str(v) for v in sorted(int(n) for n in names)]  # 2, 3, 10, not "10", "2", "3"
