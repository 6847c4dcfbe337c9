"""A local output disk that fills up mid-run (an injected ENOSPC, batchgen/faults.py `disk_full`:
the n-th atomic write fails after its temp file holds the data, as a real full disk fails):
exit 5 with a message saying so, nothing half-written visible, and a rerun with space completes
to the same rows as a clean run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pytest
from click.testing import CliRunner

from batchgen import faults
from batchgen.cli import main
from batchgen.outputs.parts import part_name
from tests.conftest import make_job, write_job, write_parquet

COLUMNS = ["row_id", "generated_text", "finish_reason", "input_tokens", "cached_tokens", "output_tokens"]
PROMPTS = ["once upon a time", "the little cat", "a dog played", "the sun", "upon a time the", "cat dog", "sun"]


def _job(tmp_path: Path, model: Path, name: str) -> tuple[Path, Path]:
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(data, {"prompt": PROMPTS})
    out = tmp_path / name
    job = make_job(model, str(data), out, engine={"window_rows": 2}, sampling={"max_tokens": 4})
    job["input"]["id_column"] = None
    return write_job(tmp_path / f"{name}.yaml", job), out


def _rows(out: Path) -> list[tuple[Any, ...]]:
    table = ds.dataset(out, format="parquet").to_table(columns=COLUMNS)
    return sorted(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> list[tuple[Any, ...]]:
    job, out = _job(tmp_path_factory.mktemp("clean"), tiny_model_dir, "out")
    assert CliRunner().invoke(main, ["run", str(job), "--quiet"]).exit_code == 0
    return _rows(out)


# The atomic writes of this job, in order: 1 the job record, 2 the runtime's claim in it, then for
# each of the four parts its description in the record and the part itself (3-10), 11 `_SUCCESS`.
@pytest.mark.parametrize(("nth", "parts_kept"), [(1, 0), (5, 1), (11, 4)])
def test_a_full_disk_stops_cleanly_and_a_rerun_completes(
    tmp_path: Path,
    tiny_model_dir: Path,
    clean: list[tuple[Any, ...]],
    monkeypatch: pytest.MonkeyPatch,
    nth: int,
    parts_kept: int,
) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out")
    monkeypatch.setenv("BATCHGEN_FAULT", f"disk_full:{nth}")
    monkeypatch.setattr(faults, "_hits", {})
    full = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert full.exit_code == 5, full.output
    assert "No space left on device" in full.stderr and "the disk is full; committed parts are kept" in full.stderr
    left = sorted(p.name for p in out.iterdir() if not p.name.endswith(".lock"))
    assert not [n for n in left if n.endswith(".tmp")]  # the failed write's temp file is gone
    assert [n for n in left if n.startswith("part-")] == [part_name(i) for i in range(parts_kept)]
    assert "_SUCCESS" not in left
    if parts_kept:
        assert len(_rows(out)) == min(2 * parts_kept, len(PROMPTS))  # every kept part reads back whole
    monkeypatch.delenv("BATCHGEN_FAULT")
    again = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert again.exit_code == 0, again.output
    assert _rows(out) == clean
