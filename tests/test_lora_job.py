"""LoRA adapters through `batchgen run`: jobs/lora.yaml on the demo model and its two sample
adapters (rows, usage, the `lora` column, `_SUCCESS` and `report --by lora`, greedy tokens equal to
transformers' generate on peft's merged model of each row's adapter); a row naming an unknown
adapter is an error row and the job goes on; an OpenAI batch file's body.model picks the adapter;
a changed adapter is refused on resume."""

from __future__ import annotations

import json
import shutil
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner

from batchgen.cli import main
from testkit.tiny_lora import merged_model, save_tiny_adapter
from tests.conftest import output_table, write_job, write_parquet

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "sample_data" / "demo-model"
ADAPTERS = REPO / "sample_data" / "lora"
JOB = REPO / "jobs" / "lora.yaml"


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pa.Table]:
    out = tmp_path_factory.mktemp("lora-demo") / "out"
    code, text = _cli("run", str(JOB), "--quiet", "--set", f"output.path={out}")
    assert code == 0, text
    return out, output_table(out)


def test_the_demo_job_answers_every_row_under_its_adapter(demo_run: tuple[Path, pa.Table]) -> None:
    _, table = demo_run
    rows = table.to_pylist()
    assert len(rows) == 24 and all(r["error_code"] is None for r in rows)
    assert [r["lora"] for r in rows] == [r["adapter"] or None for r in rows]  # "" and null: the base model
    assert {r["lora"] for r in rows} == {"storyteller", "terse", None}
    assert all(r["input_tokens"] > 0 and r["output_tokens"] > 0 for r in rows)


def test_success_and_report_give_usage_per_adapter(demo_run: tuple[Path, pa.Table]) -> None:
    out, table = demo_run
    expected: dict[str, dict[str, int]] = {}
    for r in table.to_pylist():
        one = expected.setdefault(r["lora"] or "(base)", dict.fromkeys(("rows", "ok", "input", "cached", "output"), 0))
        one["rows"] += 1
        one["ok"] += r["error_code"] is None
        for kind in ("input", "cached", "output"):
            one[kind] += r[f"{kind}_tokens"]
    assert json.loads((out / "_SUCCESS").read_text())["lora"] == expected
    code, text = _cli("report", str(out), "--by", "lora", "--json")
    assert code == 0, text
    groups = {g["group"]: g for g in json.loads(text)["groups"]}
    assert {name: (g["rows"], g["output_tokens"]) for name, g in groups.items()} == {
        name: (c["rows"], c["output"]) for name, c in expected.items()
    }


def test_more_adapters_than_slots_give_the_same_rows(demo_run: tuple[Path, pa.Table], tmp_path: Path) -> None:
    """engine.max_loras 1 under two adapters: each adapter's rows run in turn, the text unchanged."""
    _, table = demo_run
    out = tmp_path / "one-slot"
    code, text = _cli("run", str(JOB), "--quiet", "--set", f"output.path={out}", "--set", "engine.max_loras=1")
    assert code == 0, text
    one = output_table(out).to_pylist()
    assert [(r["lora"], r["generated_text"]) for r in one] == [
        (r["lora"], r["generated_text"]) for r in table.to_pylist()
    ]


def test_greedy_tokens_equal_peft_merged_models(demo_run: tuple[Path, pa.Table]) -> None:
    """One row of each adapter and of the base model against transformers' generate on the merged weights."""
    from transformers import AutoTokenizer

    _, table = demo_run
    tokenizer = AutoTokenizer.from_pretrained(DEMO)
    rows = table.to_pylist()
    picked = {r["lora"]: r for r in reversed(rows)}  # (the first row of each)
    differs = 0
    for name, row in picked.items():
        model = merged_model(DEMO, None if name is None else ADAPTERS / name)
        ids = tokenizer(row["prompt"], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
        assert tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == row["generated_text"], name
        if name is not None:
            base = merged_model(DEMO, None)
            with torch.no_grad():
                plain = base.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=0)
            differs += not torch.equal(plain, out)
    assert differs == 2  # both adapters change the text of their row


def _small_job(tmp: Path, adapters: dict[str, str], names: list[Any], out: str = "out", **settings: Any) -> Path:
    write_parquet(
        tmp / "in.parquet",
        {"id": [f"r{i}" for i in range(len(names))], "prompt": ["Once upon a time"] * len(names), "adapter": names},
    )
    job = {
        "model": {"path": str(DEMO), "lora": adapters},
        "input": {"path": str(tmp / "in.parquet"), "id_column": "id", "lora_column": "adapter"},
        "output": {"path": str(tmp / out)},
        "sampling": {"max_tokens": 4},
        "engine": {"backend": "native"},
    }
    if "grouping" in settings:
        job["input"]["grouping"] = settings.pop("grouping")
    job["engine"].update(settings)
    return write_job(tmp / f"{out}.yaml", job)


def test_a_row_naming_an_unknown_adapter_is_an_error_row(tmp_path: Path) -> None:
    adapters = {"storyteller": str(ADAPTERS / "storyteller")}
    job = _small_job(tmp_path, adapters, ["storyteller", "nope", None, "storyteller"])
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    rows = output_table(tmp_path / "out").to_pylist()
    assert [r["error_code"] for r in rows] == [None, "unknown_adapter", None, None]
    message = rows[1]["error_message"]
    assert "'nope'" in message and str(tmp_path / "in.parquet") in message and "row 1" in message
    assert "storyteller" in message  # the adapters the job has
    assert rows[1]["lora"] == "nope" and rows[1]["input_tokens"] == 0
    assert rows[0]["generated_text"] == rows[3]["generated_text"]  # same prompt, same adapter
    success = json.loads((tmp_path / "out" / "_SUCCESS").read_text())
    assert success["error_codes"] == {"unknown_adapter": 1}
    assert success["lora"]["nope"] == {"rows": 1, "ok": 0, "input": 0, "cached": 0, "output": 0}


def test_a_changed_adapter_is_refused_on_resume(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen import faults

    folder = shutil.copytree(ADAPTERS / "terse", tmp_path / "mine")
    saved = shutil.copytree(folder, tmp_path / "saved")
    job = _small_job(tmp_path, {"mine": str(folder)}, ["mine", None, "mine"], window_rows=1, grouping="none")
    monkeypatch.setattr(faults, "_hits", {})
    monkeypatch.setenv("BATCHGEN_FAULT", "engine_exception:2")  # the engine fails on the second part
    code, text = _cli("run", str(job), "--quiet")
    assert code == 6, text
    monkeypatch.delenv("BATCHGEN_FAULT")
    assert len(list((tmp_path / "out").glob("part-*.parquet"))) == 1 and not (tmp_path / "out" / "_SUCCESS").exists()
    save_tiny_adapter(DEMO, folder, r=4, seed=9, scale=0.08)  # same name, other weights
    code, text = _cli("run", str(job), "--quiet")
    assert code == 2, text
    assert "LoRA adapter mine changed" in text
    shutil.rmtree(folder)
    shutil.copytree(saved, folder)  # the adapter the output was made with: the run resumes
    code, text = _cli("run", str(job))
    assert code == 0, text
    assert "resumed: 1 part(s) kept" in text
    assert [r["lora"] for r in output_table(tmp_path / "out").to_pylist()] == ["mine", None, "mine"]


def test_openai_batch_body_model_picks_the_adapter(tmp_path: Path) -> None:
    lines = [
        {"custom_id": "a", "url": "/v1/completions", "body": {"model": "storyteller", "prompt": "Once upon a time"}},
        {"custom_id": "b", "url": "/v1/completions", "body": {"model": "demo", "prompt": "Once upon a time"}},
        {"custom_id": "c", "url": "/v1/completions", "body": {"model": "terse", "prompt": "Once upon a time"}},
    ]
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = {
        "model": {"path": str(DEMO), "lora": {n: str(ADAPTERS / n) for n in ("storyteller", "terse")}},
        "input": {"path": str(tmp_path / "requests.jsonl"), "format": "openai_batch"},
        "output": {"path": str(tmp_path / "out")},
        "sampling": {"max_tokens": 8},
        "engine": {"backend": "native"},
    }
    code, text = _cli("run", str(write_job(tmp_path / "job.yaml", job)), "--quiet")
    assert code == 0, text
    rows = output_table(tmp_path / "out").to_pylist()
    assert [(r["custom_id"], r["lora"], r["error_code"]) for r in rows] == [
        ("a", "storyteller", None),
        ("b", None, None),
        ("c", "terse", None),
    ]
    texts = {r["custom_id"]: r["generated_text"] for r in rows}
    assert len(set(texts.values())) == 3  # one prompt, three sets of weights


def test_an_adapter_on_an_object_store_is_fetched_to_a_local_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.s3_server import moto_s3

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    with moto_s3() as s3:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            with s3["fs"].open_output_stream(f"inputs/adapters/story/{name}") as out:
                out.write((ADAPTERS / "storyteller" / name).read_bytes())
        query = f"?endpoint_override={s3['host']}:{s3['port']}&scheme=http&region=us-east-1"
        adapters = {"remote": f"s3://inputs/adapters/story{query}", "local": str(ADAPTERS / "storyteller")}
        job = _small_job(tmp_path, adapters, ["remote", "local", None])
        code, text = _cli("validate", str(job))
        assert code == 0, text
        assert "model.lora.remote: rank 8" in text and "endpoint_override" not in text  # the query is not shown
        code, text = _cli("run", str(job), "--quiet")
        assert code == 0, text
        rows = output_table(tmp_path / "out").to_pylist()
        assert [r["lora"] for r in rows] == ["remote", "local", None]
        assert rows[0]["generated_text"] == rows[1]["generated_text"]  # the same adapter, fetched
        cached = [p for p in (tmp_path / "cache" / "lora").iterdir() if p.name[0] != "." and p.name != "remote"]
        assert len(cached) == 1 and sorted(p.name for p in cached[0].iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        gone = _small_job(tmp_path, {"gone": f"s3://inputs/adapters/none{query}"}, ["gone"], out="gone")
        code, text = _cli("validate", str(gone))
        assert code == 4, text
        assert "model.lora.gone s3://inputs/adapters/none" in text and "no adapter_config.json" in text


def test_estimate_counts_and_prices_each_adapter(tmp_path: Path) -> None:
    prices = ["pricing.input=1", "pricing.output=2", "pricing.lora.terse.input=5"]
    prices += ["engine.window_rows=1", "input.grouping=none"]  # windows of base rows only count too
    args = ["estimate", str(JOB), "--json", "--set", f"output.path={tmp_path / 'out'}"]
    code, text = _cli(*args, *(x for p in prices for x in ("--set", p)))
    assert code == 0, text
    est = json.loads(text)
    per = est["lora"]
    assert sorted(per) == ["(base)", "storyteller", "terse"] and sum(c["rows"] for c in per.values()) == 24
    assert sum(c["input"] for c in per.values()) == est["input_tokens"]["total"]
    million = Decimal(1_000_000)
    expected = sum(Decimal(c["input"] * (5 if name == "terse" else 1)) for name, c in per.items()) / million
    assert Decimal(est["cost"]["input"]) == expected


def test_no_cached_block_crosses_adapters(tmp_path: Path) -> None:
    """One long prompt under two adapters and the base model: a row shares cached blocks only with
    rows of its own adapter (the plan and the engine both key blocks by the adapter's content)."""
    prompt = " ".join(f"The little cat saw a bird number {i}." for i in range(12))
    names = ["storyteller", "storyteller", "terse", None, None]
    adapters = {n: str(ADAPTERS / n) for n in ("storyteller", "terse")}
    job = _small_job(tmp_path, adapters, names)
    write_parquet(
        tmp_path / "in.parquet", {"id": [f"r{i}" for i in range(5)], "prompt": [prompt] * 5, "adapter": names}
    )
    code, text = _cli("run", str(job), "--quiet")
    assert code == 0, text
    rows = output_table(tmp_path / "out").to_pylist()
    cached = {}
    for r in rows:
        cached.setdefault(r["lora"], []).append(r["cached_tokens"])
    assert cached["terse"] == [0]  # the only row of its adapter: nothing to share
    for name in ("storyteller", None):  # each group computes the prompt once, its second row reuses it
        first, second = sorted(cached[name])
        assert first == 0 and second > 0, cached
