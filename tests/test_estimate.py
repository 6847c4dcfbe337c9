"""`batchgen estimate` against real runs of the same job (tiny model, hf backend): input tokens,
failing rows and the output-token ceiling agree with the run; prefix-cache replay; exact costs;
no weights are loaded."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pyarrow.compute as pc
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.usage.estimate import prefix_cache_hits
from tests.conftest import make_job, output_table, write_job, write_parquet

WORDS = "once upon a time there was a little cat who liked to play in the sun with her friend dog".split()
PREAMBLE = "you are a story teller. " + " ".join(WORDS * 2) + ". now answer: "


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def _estimate(job: Path, *args: str) -> dict:
    code, out, err = _cli("estimate", str(job), "--json", *args)
    assert code == 0, err
    assert out.endswith("}\n") and not out.endswith("\n\n")  # one newline, as a shell prompt and `jq` expect
    return json.loads(out)


def test_prefix_cache_replay_matches_full_chained_blocks() -> None:
    assert prefix_cache_hits([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], 2) == 4
    assert prefix_cache_hits([[1, 2, 3, 4], [1, 2, 3, 4]], 2) == 2  # the last token is always computed
    assert prefix_cache_hits([[1, 2, 3, 4, 5], [9, 2, 3, 4, 5]], 2) == 0  # a block matches only after its parent
    assert prefix_cache_hits([[1, 2, 3], [1, 2, 4], [1, 2, 5]], 2) == 4
    assert prefix_cache_hits([[1, 2, 3, 4, 5, 6, 7]], 2) == 0


def test_estimate_agrees_with_the_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    prompts = [" ".join(WORDS[(i * 3 + j) % len(WORDS)] for j in range(1 + i % 11)) for i in range(20)]
    prompts[2], prompts[5], prompts[9] = None, "  ", "the cat " * 200
    ids = [f"r{i}" for i in range(20)]
    ids[14] = "r1"  # a repeated id: the second use fails
    max_tokens = [None if i % 4 else 3 + i % 5 for i in range(20)]
    max_tokens[7] = -1
    write_parquet(tmp_path / "in.parquet", {"id": ids, "prompt": prompts, "mt": max_tokens})
    job = make_job(
        tiny_model_dir,
        str(tmp_path / "in.parquet"),
        tmp_path / "out",
        sampling={"max_tokens": 6, "ignore_eos": True},
        engine={"window_rows": 6},
        input={"sampling_columns": {"max_tokens": "mt"}},
    )
    job["pricing"] = {"input": 0.15, "cached_input": 0.075, "output": 0.6}
    job_path = write_job(tmp_path / "job.yaml", job)
    est = _estimate(job_path)
    code, _, err = _cli("run", str(job_path), "--quiet")
    assert code == 0, err
    table = output_table(tmp_path / "out")
    run_codes = [c for c in table.column("error_code").to_pylist() if c is not None]
    assert est["rows"] == {"total": 20, "ok": 20 - len(run_codes), "error": len(run_codes)}
    assert est["error_codes"] == {c: run_codes.count(c) for c in set(run_codes)}
    assert set(est["error_codes"]) == {"empty_prompt", "prompt_too_long", "invalid_sampling", "duplicate_id"}
    assert est["input_tokens"]["total"] == pc.sum(table.column("input_tokens")).as_py()
    ok_lengths = sorted(r["input_tokens"] for r in table.to_pylist() if r["error_code"] is None)
    assert est["input_tokens"]["max"] == ok_lengths[-1]
    assert est["input_tokens"]["p50"] == ok_lengths[math.ceil(len(ok_lengths) / 2) - 1]  # nearest rank
    # With ignore_eos every row generates its full (per-row, context-capped) max_tokens: the ceiling is exact.
    assert est["output_tokens"]["max"] == pc.sum(table.column("output_tokens")).as_py()
    assert est["prefix_cache"]["enabled"] is False and est["prefix_cache"]["cached_tokens"] == 0
    assert "hf backend has no prefix cache" in est["prefix_cache"]["assumption"]
    cost = est["cost"]
    assert Decimal(cost["input"]) == Decimal(est["input_tokens"]["total"]) * Decimal("0.15") / 1_000_000
    assert cost["input_with_cache"] == cost["input"] and cost["output_min"] == "0"
    assert Decimal(cost["output_max"]) == Decimal(est["output_tokens"]["max"]) * Decimal("0.6") / 1_000_000
    assert Decimal(cost["total_max"]) == Decimal(cost["input"]) + Decimal(cost["output_max"])


def test_shared_preamble_is_predicted_from_the_cache(tmp_path: Path, tiny_model_dir: Path) -> None:
    prompts = [PREAMBLE + " ".join(WORDS[i : i + 3]) for i in range(12)] + ["the dog", "a sun"]
    write_parquet(tmp_path / "in.parquet", {"id": [str(i) for i in range(14)], "prompt": prompts})
    job = make_job(
        tiny_model_dir,
        str(tmp_path / "in.parquet"),
        tmp_path / "out",
        engine={"backend": "native", "block_size": 4, "window_rows": 7},
    )
    job_path = write_job(tmp_path / "job.yaml", job)
    est = _estimate(job_path, "--price-input", "1", "--price-cached-input", "0.5")
    cache, total = est["prefix_cache"], est["input_tokens"]["total"]
    assert cache["enabled"] and 0 < cache["cached_tokens"] <= total
    preamble_blocks = est["input_tokens"]["max"] // 4 - 2  # most of each prompt is the preamble
    assert cache["cached_tokens"] >= 10 * preamble_blocks * 4  # 12 sharers in 2 windows: 10 hit
    assert "an unbounded cache within each of the job's" in cache["assumption"] and cache["grouping"] == "prefix plan"
    discounted = Decimal(total) - Decimal(cache["cached_tokens"]) / 2
    assert Decimal(est["cost"]["input_with_cache"]) == discounted / 1_000_000
    off = _estimate(job_path, "--set", "engine.enable_prefix_caching=false")
    assert off["prefix_cache"]["cached_tokens"] == 0
    assert off["prefix_cache"]["shareable_tokens"] == cache["cached_tokens"]
    whole = _estimate(job_path, "--set", "engine.window_rows=100")
    # the prefix plan keeps the 12 sharers in consecutive parts of one group, whose cache is kept
    # from part to part: one window of all rows serves no more
    assert whole["prefix_cache"]["cached_tokens"] == cache["cached_tokens"]
    apart = _estimate(job_path, "--set", "input.grouping=none")  # windows of 7 in input order: 12 sharers in 2
    assert apart["prefix_cache"]["cached_tokens"] < cache["cached_tokens"]


def test_chat_messages_no_weights_and_the_text_table(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    for weights in model.glob("*.safetensors"):
        weights.unlink()  # the estimate must not need them
    convs = [
        [{"role": "user", "content": "tell me about the cat"}],
        [{"role": "system", "content": "be short"}, {"role": "user", "content": "a dog"}],
        [],
    ]
    write_parquet(tmp_path / "in.parquet", {"id": ["x", "y", "z"], "messages": convs})
    job = make_job(model, str(tmp_path / "in.parquet"), tmp_path / "out")
    job["input"] = {"path": str(tmp_path / "in.parquet"), "messages_column": "messages", "id_column": "id"}
    job_path = write_job(tmp_path / "job.yaml", job)
    est = _estimate(job_path)
    tok = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(tiny_model_dir)
    rendered = [
        tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True) for c in convs[:2]
    ]
    expected = sum(len(r["input_ids"]) for r in rendered)
    assert est["input_tokens"]["total"] == expected and est["error_codes"] == {"empty_prompt": 1}
    assert est["cost"]["input"] is None and est["context_length"] == 256
    code, text, err = _cli("estimate", str(job_path))
    assert code == 0, err
    assert f"total {expected}" in text and "would fail: empty_prompt 1" in text and "no prices" in text
    code, _, err = _cli("estimate", str(job_path), "--set", "input.messages_column=nope")
    assert code == 3 and "nope" in err


def test_a_prompt_beyond_the_tokenizers_maximum_ends_without_transformers_warning(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """batchgen counts a too-long prompt itself (prompt_too_long); transformers' "Token indices
    sequence length is longer than the specified maximum" warning would be the last line."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 256
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_parquet(tmp_path / "in.parquet", {"id": ["a", "b"], "prompt": ["the cat " * 300, "a dog"]})
    job = write_job(tmp_path / "job.yaml", make_job(model, str(data), tmp_path / "out"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSFORMERS_", "HF_HUB_"))}
    done = subprocess.run(
        [sys.executable, "-m", "batchgen", "estimate", str(job)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "prompt_too_long 1" in done.stdout
    assert "Token indices sequence length" not in done.stderr, done.stderr
