"""The quickstart job, end to end on the committed demo model and sample prompts (native engine)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import output_table

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quickstart_job_runs_on_the_demo_model(tmp_path: Path) -> None:
    out = tmp_path / "quickstart"
    args = [
        "run",
        str(REPO / "jobs/quickstart.yaml"),
        "--quiet",
        "--set",
        f"output.path={out}",
        "--set",
        "input.limit=48",
        "--set",
        "sampling.max_tokens=24",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "48 rows ok, 0 failed" in result.output
    rows = output_table(out).to_pylist()
    assert len(rows) == 48 and all(r["generated_text"] for r in rows)
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    fewshot = [r for r in rows if r["category"].startswith("fewshot")]
    assert fewshot and sum(r["cached_tokens"] > 0 for r in fewshot) >= len(fewshot) - 2  # the preamble is shared
    manifest = json.loads((out / "_SUCCESS").read_text())
    assert manifest["backend"] == "native" and manifest["tokens"]["cached"] == sum(r["cached_tokens"] for r in rows)


@pytest.mark.slow
def test_samples_job_runs_on_the_demo_model_and_is_batch_invariant(tmp_path: Path) -> None:
    """jobs/samples.yaml: 4 seeded samples per row; a row's samples do not depend on the rows beside it."""

    def run(name: str, limit: int, window: int) -> list[dict]:
        sets = [f"output.path={tmp_path / name}", f"input.limit={limit}", "sampling.max_tokens=16"]
        args = ["run", str(REPO / "jobs/samples.yaml"), "--quiet", *[a for s in sets for a in ("--set", s)]]
        result = CliRunner().invoke(main, [*args, "--set", f"engine.window_rows={window}"])
        assert result.exit_code == 0, result.output
        return output_table(tmp_path / name).to_pylist()

    rows = run("all", 8, 8)
    assert len(rows) == 8 and all(len(r["generated_text"]) == 4 for r in rows)
    assert all(r["output_tokens"] == sum(r["sample_output_tokens"]) for r in rows)
    assert any(len(set(r["generated_text"])) > 1 for r in rows)  # temperature 0.8: samples differ
    few = run("few", 3, 1)  # other batches: one row at a time
    assert [r["generated_text"] for r in few] == [r["generated_text"] for r in rows[:3]]


def test_every_shipped_job_file_validates() -> None:
    """The README's commands use these files (jobs/nightly.yaml above all): each must pass
    `batchgen validate` on the committed demo model and sample prompts."""
    jobs = sorted((REPO / "jobs").glob("*.yaml"))
    assert "nightly.yaml" in {j.name for j in jobs}
    for job in jobs:
        result = CliRunner().invoke(main, ["validate", str(job)])
        assert result.exit_code == 0, (job.name, result.output)
        special = {"openai_batch.yaml": "openai_requests.jsonl: 4 rows", "lora.yaml": "lora_prompts.parquet: 24 rows"}
        data = special.get(job.name, "prompts.parquet: 2400 rows")
        assert f"{REPO / 'sample_data' / data}" in result.output


def test_every_job_file_the_readme_names_is_shipped() -> None:
    named = set(re.findall(r"\bjobs/[\w.-]+\.yaml\b", (REPO / "README.md").read_text()))
    assert named and {n for n in named if not (REPO / n).exists()} == set()
