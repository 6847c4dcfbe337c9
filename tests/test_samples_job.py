"""n samples, logprobs and prompt_logprobs through `batchgen run`: column types from the job,
values against transformers' own logits, the bill (output_tokens sums the samples), the
fingerprint, `report` counting samples, `estimate` x n, and the hf backend refusing them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import make_job, output_table, write_job, write_parquet

PROMPTS = ["once upon a time", "the little cat liked to", "   ", "her friend dog was in the sun"]
TOL = 1e-4


def _job(tmp: Path, model: Path, name: str, **sampling: Any) -> Path:
    job = make_job(
        model,
        str(tmp / "in.parquet"),
        tmp / name,
        engine={"backend": "native", "window_rows": 2},
        sampling={"max_tokens": 6, **sampling},
    )
    return write_job(tmp / f"{name}.yaml", job)


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("samples")
    write_parquet(tmp / "in.parquet", {"id": [f"r{i}" for i in range(len(PROMPTS))], "prompt": PROMPTS})
    return tmp


@pytest.fixture(scope="module")
def sampled(inputs: Path, tiny_model_dir: Path) -> tuple[Path, pa.Table]:
    job = _job(inputs, tiny_model_dir, "n3", n=3, temperature=0.8, seed=1, logprobs=2, prompt_logprobs=1)
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    return job, output_table(inputs / "n3")


def _raw(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)


def test_column_types_follow_the_job(sampled: tuple[Path, pa.Table]) -> None:
    _, table = sampled
    schema = table.schema
    for name in ("generated_text", "finish_reason", "stop_reason"):
        assert schema.field(name).type == pa.list_(pa.string()), name
    for name in ("input_tokens", "cached_tokens", "output_tokens"):
        assert schema.field(name).type == pa.int64(), name
    assert schema.field("sample_output_tokens").type == pa.list_(pa.int64())
    assert schema.field("cumulative_logprob").type == pa.list_(pa.float64())
    assert pa.types.is_list(schema.field("logprobs").type.value_type)  # a list of n lists of structs
    assert pa.types.is_struct(schema.field("prompt_logprobs").type.value_type)
    rows = table.to_pylist()
    ok, bad = [r for r in rows if r["error_code"] is None], [r for r in rows if r["error_code"]]
    assert len(ok) == 3 and [r["error_code"] for r in bad] == ["empty_prompt"]
    assert bad[0]["finish_reason"] == ["error"] * 3 and bad[0]["generated_text"] is None
    assert bad[0]["logprobs"] is None and bad[0]["prompt_logprobs"] is None
    for row in ok:
        assert len(row["generated_text"]) == len(row["finish_reason"]) == len(row["sample_output_tokens"]) == 3
        assert row["output_tokens"] == sum(row["sample_output_tokens"])  # the bill: every sample


def test_logprobs_match_transformers(sampled: tuple[Path, pa.Table], tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    _, table = sampled
    row = table.to_pylist()[1]
    prompt = tok(row["prompt"])["input_ids"]
    assert row["input_tokens"] == len(prompt)
    for sample, cumulative in zip(row["logprobs"], row["cumulative_logprob"]):
        generated = [entry["token_id"] for entry in sample]
        raw = _raw(tiny_model_dir, prompt + generated)
        for j, entry in enumerate(sample):
            want = raw[len(prompt) - 1 + j]
            assert abs(entry["logprob"] - float(want[entry["token_id"]])) < TOL
            assert [t["token_id"] for t in entry["top"]] == want.topk(2).indices.tolist()
        assert cumulative == pytest.approx(sum(e["logprob"] for e in sample), abs=1e-9)
    raw = _raw(tiny_model_dir, prompt)
    scored = row["prompt_logprobs"]
    assert scored[0] is None and [e["token_id"] for e in scored[1:]] == prompt[1:]
    for j in range(1, len(prompt)):
        assert abs(scored[j]["logprob"] - float(raw[j - 1, prompt[j]])) < TOL


def test_report_counts_samples_and_matches_success(sampled: tuple[Path, pa.Table], inputs: Path) -> None:
    code, out = _cli("report", str(inputs / "n3"), "--json")
    assert code == 0, out
    totals = json.loads(out)["totals"]
    assert totals["samples"] == 4 * 3 and sum(totals["finish_reasons"].values()) == 12
    assert totals["finish_reasons"]["error"] == 3
    _, table = sampled
    lengths = [n for row in table.to_pylist() if row["error_code"] is None for n in row["sample_output_tokens"]]
    assert totals["output_tokens_mean"] == round(sum(lengths) / len(lengths), 2)
    code, out = _cli("report", str(inputs / "n3"))
    assert code == 0 and "12 samples in 4 rows" in out


def test_n_is_part_of_the_fingerprint(sampled: tuple[Path, pa.Table]) -> None:
    job, _ = sampled
    code, out = _cli("run", str(job), "--quiet", "--set", "sampling.n=2")
    assert code == 2 and "sampling.n: 3 -> 2" in out


def test_n_and_logprobs_enter_the_fingerprint_only_when_set(inputs: Path, tiny_model_dir: Path) -> None:
    """(At their defaults they stay out, so older outputs resume: test_features_job checks the whole set.)"""
    from batchgen.job.spec import load_job
    from batchgen.outputs.fingerprint import job_fingerprint

    asked = job_fingerprint(load_job(_job(inputs, tiny_model_dir, "fp2", n=2, logprobs=0)), [])["settings"]["sampling"]
    assert (asked["n"], asked["logprobs"]) == (2, 0) and "prompt_logprobs" not in asked


def test_estimate_multiplies_the_output_range_by_n(inputs: Path, tiny_model_dir: Path) -> None:
    one = json.loads(_cli("estimate", str(_job(inputs, tiny_model_dir, "e1")), "--json")[1])
    four = json.loads(_cli("estimate", str(_job(inputs, tiny_model_dir, "e4", n=4)), "--json")[1])
    assert one["output_tokens"]["max"] == 3 * 6 and four["output_tokens"]["max"] == 4 * 3 * 6
    assert four["input_tokens"] == one["input_tokens"]  # the prompt is billed once


def test_hf_backend_answers_max_tokens_zero_with_empty_completions(inputs: Path, tiny_model_dir: Path) -> None:
    job = _job(inputs, tiny_model_dir, "hf-zero", max_tokens=0)
    code, text = _cli("run", str(job), "--quiet", "--set", "engine.backend=hf")
    assert code == 0, text
    rows = [r for r in output_table(inputs / "hf-zero").to_pylist() if r["error_code"] is None]
    assert len(rows) == 3 and {(r["generated_text"], r["output_tokens"], r["finish_reason"]) for r in rows} == {
        ("", 0, "length")
    }


def test_scoring_job_with_max_tokens_zero(inputs: Path, tiny_model_dir: Path) -> None:
    code, text = _cli("run", str(_job(inputs, tiny_model_dir, "score", max_tokens=0, prompt_logprobs=0)), "--quiet")
    assert code == 0, text
    rows = [r for r in output_table(inputs / "score").to_pylist() if r["error_code"] is None]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    for row in rows:
        assert (row["generated_text"], row["output_tokens"], row["finish_reason"]) == ("", 0, "length")
        prompt = tok(row["prompt"])["input_ids"]
        raw = _raw(tiny_model_dir, prompt)
        total = sum(e["logprob"] for e in row["prompt_logprobs"][1:])
        assert total == pytest.approx(float(sum(raw[j - 1, prompt[j]] for j in range(1, len(prompt)))), abs=1e-3)
        assert all(e["top"] == [] for e in row["prompt_logprobs"][1:])  # K = 0: the token's own logprob only


@pytest.mark.parametrize("key, value", [("n", 2), ("logprobs", 1), ("prompt_logprobs", 0)])
def test_hf_backend_refuses_before_any_work(inputs: Path, tiny_model_dir: Path, key: str, value: int) -> None:
    job = _job(inputs, tiny_model_dir, f"hf-{key}", **{key: value})
    code, out = _cli("run", str(job), "--quiet", "--set", "engine.backend=hf")
    assert code == 2 and f"sampling.{key}: engine.backend hf does not support" in out
    assert not (inputs / f"hf-{key}").exists()
