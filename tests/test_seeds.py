"""sampling.seed is a run seed: each row's seed comes from it and the row's id, so duplicated
prompts draw different samples, and a rerun, another window size, ordering or hf batch size draws
the same ones; a per-row seed column wins. Both backends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.inputs.row_values import row_seed
from tests.conftest import make_job, output_table, write_job, write_parquet

ROWS = 6


def _run(tmp_path: Path, model: Path, name: str, with_ids: bool = True, **sections: dict[str, Any]) -> dict[str, str]:
    """Run the job into out-<name>; {id or row_id: generated_text}."""
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(
            data,
            {
                "id": [f"r{i}" for i in range(ROWS)],
                "prompt": ["the cat"] * ROWS,
                "own_seed": [None, None, None, None, 5, 5],
            },
        )
    out = tmp_path / f"out-{name}"
    job = make_job(model, str(data), out, sampling={"max_tokens": 6, "temperature": 1.0, "seed": 7, "ignore_eos": True})
    job["input"]["sampling_columns"] = {"seed": "own_seed"}
    if not with_ids:
        job["input"]["id_column"] = None
    for section, values in sections.items():
        job[section].update(values)
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / f"{name}.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output
    rows = output_table(out).to_pylist()
    assert all(r["error_code"] is None for r in rows)
    return {r["id"] if with_ids else r["row_id"]: r["generated_text"] for r in rows}


def test_row_seed_is_stable_and_differs_per_row() -> None:
    assert row_seed(7, "id:a") == row_seed(7, "id:a")
    assert len({row_seed(7, f"id:{i}") for i in range(100)}) == 100
    assert row_seed(7, "id:a") != row_seed(8, "id:a")
    assert all(0 <= row_seed(s, "k") < 1 << 64 for s in (0, -1, (1 << 64) - 1))


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_duplicated_prompts_draw_different_samples_the_same_on_every_run(
    tmp_path: Path, tiny_model_dir: Path, backend: str
) -> None:
    first = _run(tmp_path, tiny_model_dir, "a", engine={"backend": backend})
    unseeded = [first[f"r{i}"] for i in range(4)]
    assert len(set(unseeded)) == 4, unseeded  # one prompt, four ids: four different samples
    assert first["r4"] == first["r5"]  # the per-row seed column wins over the run seed
    again = _run(
        tmp_path,
        tiny_model_dir,
        "b",
        engine={"backend": backend, "window_rows": 1, "ordering": "none", "batch_size": 1},
    )
    assert again == first  # another window size, ordering and (hf) batch size: the same draws


def test_without_an_id_column_the_row_id_keys_the_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    first = _run(tmp_path, tiny_model_dir, "a", with_ids=False, engine={"backend": "native"})
    assert len({first[k] for k in list(first)[:4]}) == 4
    again = _run(tmp_path, tiny_model_dir, "b", with_ids=False, engine={"backend": "native", "window_rows": 2})
    assert again == first


def test_seeded_rows_draw_the_same_tokens_on_both_backends(tmp_path: Path, tiny_model_dir: Path) -> None:
    # float32 on CPU gives both backends the same logits; the hf backend then draws each seeded
    # row with the native Sampler and the row's own generator, so the tokens agree
    assert _run(tmp_path, tiny_model_dir, "hf", engine={"backend": "hf"}) == _run(
        tmp_path, tiny_model_dir, "native", engine={"backend": "native"}
    )


def test_seeded_rows_with_penalties_draw_the_same_tokens_on_both_backends(tmp_path: Path, tiny_model_dir: Path) -> None:
    # the hf backend's seeded rows go through the engine's sampler with their logits features
    # (repetition penalty, bias, min_tokens), not transformers' processors: one sampler path
    features = {"repetition_penalty": 1.3, "logit_bias": {5: 2.0}, "min_tokens": 4}
    hf = _run(tmp_path, tiny_model_dir, "hf", engine={"backend": "hf"}, sampling=features)
    assert hf == _run(tmp_path, tiny_model_dir, "native", engine={"backend": "native"}, sampling=features)
