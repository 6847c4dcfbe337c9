"""Pooling jobs end to end through `batchgen run`: task embed / classify / score write their
columns (values equal to the LLM API's, which tests/test_pooling checks against transformers),
usage (input and cached tokens, output 0), per-row errors, resume, and job-file errors that
name the key before any work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen import LLM
from batchgen.cli import main
from batchgen.job.spec import load_job
from batchgen.outputs.fingerprint import job_fingerprint
from testkit.pooling_models import save_llama_classifier, save_tiny_bert
from tests.conftest import build_tokenizer, write_job, write_parquet
from tests.s3_server import moto_s3, options

PREFIX = "once upon a time there was a little cat who liked to play in the sun "
PROMPTS = [PREFIX * 2 + "dog", "the sun", None, "  ", PREFIX * 2 + "with her friend", "cat"]
DOCS = ["the cat", "a dog", "sun", "x", None, "friend"]


def _job(tmp_path: Path, model: Path, task: str, **extra: Any) -> Path:
    inputs = write_parquet(tmp_path / "in.parquet", {"id": list(range(6)), "prompt": PROMPTS, "doc": DOCS})
    job: dict[str, Any] = {
        "task": task,
        "model": {"path": str(model)},
        "input": {"path": str(inputs), "id_column": "id"},
        "output": {"path": str(tmp_path / "out")},
        "engine": {"window_rows": 4},  # two parts
    }
    job.update(extra)
    return write_job(tmp_path / "job.yaml", job)


def _run(job: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    return result.exit_code, result.output


def _table(tmp_path: Path) -> pa.Table:
    return ds.dataset(tmp_path / "out", format="parquet").to_table().sort_by("id")


def test_embed_job_on_the_engine(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir, "embed", pooling={"embedding_dtype": "float16"})
    code, output = _run(job)
    assert code == 0, output
    table = _table(tmp_path)
    assert table.schema.field("embedding").type == pa.list_(pa.float16(), 64)
    assert table.column("error_code").to_pylist() == [None, None, "empty_prompt", "empty_prompt", None, None]
    assert table.column("output_tokens").to_pylist() == [0] * 6
    ok = [0, 1, 4, 5]
    expected = LLM(str(tiny_model_dir), task="embed").embed([PROMPTS[i] for i in ok])
    got = table.column("embedding").to_pylist()
    for i, out in zip(ok, expected):
        np.testing.assert_allclose(got[i], out.outputs.embedding, atol=2e-3)  # float16 storage
        assert table.column("input_tokens")[i].as_py() == len(out.prompt_token_ids)
    assert got[2] is None and table.column("finish_reason").to_pylist()[0] == "pooled"
    assert sum(table.column("cached_tokens").to_pylist()) > 0  # rows 0 and 4 share a prefix (the cache outlives a part)
    code, output = _run(job)  # everything committed: the rerun resumes with nothing to do
    assert code == 0, output
    assert _table(tmp_path).equals(table)


def test_classify_and_pair_score_jobs(tmp_path: Path) -> None:
    model = save_tiny_bert(tmp_path / "clf", num_labels=2)
    code, output = _run(_job(tmp_path / "a", model, "classify"))
    assert code == 0, output
    table = _table(tmp_path / "a")
    expected = LLM(str(model), task="classify").classify([PROMPTS[i] for i in (0, 1, 4, 5)])
    probs, labels = table.column("probs").to_pylist(), table.column("label").to_pylist()
    for i, out in zip((0, 1, 4, 5), expected):
        np.testing.assert_allclose(probs[i], out.outputs.probs, atol=1e-6)
        assert labels[i] == out.outputs.label
    assert probs[2] is None and labels[3] is None

    scorer = save_tiny_bert(tmp_path / "ce", num_labels=1)
    pooling = {"score": "pair", "document_column": "doc"}
    code, output = _run(_job(tmp_path / "b", scorer, "score", pooling=pooling))
    assert code == 0, output
    table = _table(tmp_path / "b")
    llm = LLM(str(scorer), task="score")
    scores = table.column("score").to_pylist()
    for i in (0, 1, 5):
        assert scores[i] == pytest.approx(llm.score(PROMPTS[i], DOCS[i])[0].outputs.score, abs=1e-6)
    assert table.column("error_code").to_pylist()[4] == "empty_document" and scores[4] is None


@pytest.mark.parametrize(
    ("task", "extra", "key"),
    [
        ("embed", {"sampling": {"max_tokens": 4}}, "sampling.max_tokens"),
        ("score", {}, "pooling.score"),
        ("score", {"pooling": {"score": "pair"}}, "pooling"),
        ("generate", {"pooling": {"normalize": False}}, "pooling"),
        ("classify", {"pooling": {"dimensions": 8}}, "pooling.dimensions"),
    ],
)
def test_job_file_errors_name_the_key(tmp_path: Path, tiny_model_dir: Path, task: str, extra: Any, key: str) -> None:
    code, output = _run(_job(tmp_path, tiny_model_dir, task, **extra))
    assert code != 0
    assert key in output
    assert not (tmp_path / "out").exists()  # refused before any work


def test_embed_job_in_static_shards_equals_one_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    whole = _job(tmp_path / "whole", tiny_model_dir, "embed", pooling={"pooling_type": "mean"})
    assert _run(whole)[0] == 0
    sharded = _job(tmp_path / "sharded", tiny_model_dir, "embed", pooling={"pooling_type": "mean"})
    for shard in ("0/2", "1/2"):
        result = CliRunner().invoke(main, ["run", str(sharded), "--quiet", "--shard", shard])
        assert result.exit_code == 0, result.output
    assert CliRunner().invoke(main, ["finalize", str(tmp_path / "sharded" / "out")]).exit_code == 0
    one, two = _table(tmp_path / "whole"), _table(tmp_path / "sharded")
    assert one.column("error_code").equals(two.column("error_code"))
    np.testing.assert_allclose(
        np.array([v for v in one.column("embedding").to_pylist() if v is not None]),
        np.array([v for v in two.column("embedding").to_pylist() if v is not None]),
        atol=1e-6,
    )


@pytest.mark.slow
def test_embed_job_on_ray_equals_a_local_run(tmp_path: Path, tiny_model_dir: Path) -> None:
    ray = pytest.importorskip("ray")
    local = _job(tmp_path / "local", tiny_model_dir, "embed", pooling={"pooling_type": "mean"})
    assert _run(local)[0] == 0
    executor = {"kind": "ray", "num_workers": 2, "worker_cpus": 1}
    on_ray = _job(tmp_path / "ray", tiny_model_dir, "embed", pooling={"pooling_type": "mean"}, executor=executor)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        code, output = _run(on_ray)
    finally:
        ray.shutdown()
    assert code == 0, output
    one, two = _table(tmp_path / "local"), _table(tmp_path / "ray")
    assert one.column("error_code").equals(two.column("error_code"))
    assert one.column("input_tokens").equals(two.column("input_tokens"))
    np.testing.assert_allclose(
        np.array([v for v in one.column("embedding").to_pylist() if v is not None]),
        np.array([v for v in two.column("embedding").to_pylist() if v is not None]),
        atol=1e-6,
    )


def test_reward_model_row_scores_on_the_engine(tmp_path: Path) -> None:
    model = save_llama_classifier(tmp_path / "rm", build_tokenizer(), 1)
    code, output = _run(_job(tmp_path, model, "score", pooling={"score": "row"}))
    assert code == 0, output
    table = _table(tmp_path)
    expected = LLM(str(model), task="classify").classify([PROMPTS[i] for i in (0, 1, 4, 5)])
    scores = table.column("score").to_pylist()
    for i, out in zip((0, 1, 4, 5), expected):
        assert scores[i] == pytest.approx(out.outputs.probs[0], abs=1e-6)
    assert sum(table.column("cached_tokens").to_pylist()) > 0  # last-token heads reuse shared prefixes


def test_row_scores_need_a_classifier_head(tmp_path: Path, tiny_model_dir: Path) -> None:
    code, output = _run(_job(tmp_path, tiny_model_dir, "score", pooling={"score": "row"}))
    assert code != 0 and "pooling.score row needs a sequence-classification head" in output
    assert not list((tmp_path / "out").glob("part-*"))  # refused when the model loads, before any part


def test_classify_job_to_a_bucket_equals_a_local_run(tmp_path: Path) -> None:
    model = save_tiny_bert(tmp_path / "clf", num_labels=2)
    assert _run(_job(tmp_path / "local", model, "classify"))[0] == 0
    with moto_s3() as s3:
        job = _job(
            tmp_path / "s3", model, "classify", output={"path": "s3://outputs/clf", "storage_options": options(s3)}
        )
        code, output = _run(job)
        assert code == 0, output
        remote = ds.dataset("outputs/clf", format="parquet", filesystem=s3["fs"]).to_table().sort_by("id")
    local = _table(tmp_path / "local")
    for name in ("label", "probs", "error_code", "input_tokens", "finish_reason"):
        assert remote.column(name).equals(local.column(name)), name


def test_fingerprint_names_the_task_and_keeps_generate_outputs_resumable(tmp_path: Path, tiny_model_dir: Path) -> None:
    generate = job_fingerprint(load_job(_job(tmp_path / "g", tiny_model_dir, "generate")), [])["settings"]
    assert "task" not in generate and "pooling" not in generate  # as before pooling jobs existed
    embed = job_fingerprint(load_job(_job(tmp_path / "e", tiny_model_dir, "embed", pooling={"dimensions": 8})), [])
    assert embed["settings"]["task"] == "embed" and embed["settings"]["pooling"]["dimensions"] == 8


def test_dimensions_beyond_the_hidden_size_fail_at_load(tmp_path: Path, tiny_model_dir: Path) -> None:
    code, output = _run(_job(tmp_path, tiny_model_dir, "embed", pooling={"dimensions": 65}))
    assert code != 0 and "pooling.dimensions 65 exceeds the model's hidden size 64" in output
    assert not list((tmp_path / "out").glob("part-*"))


def test_embed_job_over_messages_embeds_the_conversation_without_an_assistant_opening(tmp_path: Path) -> None:
    """A chat row is embedded as the conversation itself: the template rendered without the
    generation prompt (the assistant turn's opening tokens are no content of the row)."""
    demo = Path(__file__).resolve().parents[1] / "sample_data" / "demo-model"
    conversation = [{"role": "user", "content": "Tell me about the little cat in the sun."}]
    inputs = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [0], "messages": [conversation]}), inputs)
    job = {
        "task": "embed",
        "model": {"path": str(demo)},
        "input": {"path": str(inputs), "id_column": "id", "messages_column": "messages"},
        "output": {"path": str(tmp_path / "out")},
    }
    code, output = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 0, output
    llm = LLM(str(demo), task="embed")
    plain = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=False)
    opened = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert plain != opened  # the demo template has an assistant opening, so the test can tell them apart
    want = llm.embed([plain])[0]
    table = _table(tmp_path)
    assert table.column("input_tokens")[0].as_py() == len(want.prompt_token_ids)
    np.testing.assert_allclose(table.column("embedding")[0].as_py(), want.outputs.embedding, atol=1e-6)
