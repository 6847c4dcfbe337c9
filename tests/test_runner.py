"""End-to-end job runs on a tiny random model through the CLI: inputs, output schema and order,
error rows, exact usage, chat templates, per-row settings. Backend: hf (the reference)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from transformers import AutoTokenizer

from batchgen.cli import main
from batchgen.outputs.table import RESULT_NAMES
from tests.conftest import make_job, output_table, save_tiny_llama, write_job, write_parquet

WORDS = "once upon a time there was a little cat who liked to play in the sun with her friend dog".split()
PROMPTS = ["once upon a time", "the little cat", "a dog who liked to play in the sun", "her friend"]


def _run(job_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["run", str(job_path), "--quiet", *args])
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def _read(out: Path) -> pa.Table:
    return output_table(out)


def test_glob_folder_and_file_inputs_keep_input_order(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data"
    for f in range(3):
        ids = [f"f{f}-{i}" for i in range(7)]
        write_parquet(data / f"in{f}.parquet", {"id": ids, "prompt": [PROMPTS[i % 4] * (i + 1) for i in range(7)]})
    expected = [f"f{f}-{i}" for f in range(3) for i in range(7)]
    for k, inputs in enumerate([str(data / "in*.parquet"), str(data)]):
        out = tmp_path / f"out{k}"
        code, text = _run(
            write_job(tmp_path / f"job{k}.yaml", make_job(tiny_model_dir, inputs, out, engine={"window_rows": 5}))
        )
        assert code == 0, text
        table = _read(out)
        assert table.column("id").to_pylist() == expected
        assert table.schema.names == ["id", "prompt", "input_row", *RESULT_NAMES]
        assert set(table.column("finish_reason").to_pylist()) <= {"stop", "length"}
        manifest = json.loads((out / "_SUCCESS").read_text())
        assert manifest["rows"] == {"total": 21, "ok": 21, "error": 0}
        assert manifest["parts"] == 3 * 2  # 7 rows per file in windows of 5
    single = tmp_path / "single"
    code, text = _run(write_job(tmp_path / "j.yaml", make_job(tiny_model_dir, str(data / "in1.parquet"), single)))
    assert code == 0, text
    assert _read(single).column("id").to_pylist() == expected[7:14]


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_usage_equals_tokenizer_counts(tmp_path: Path, tiny_model_dir: Path, backend: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [p * k for k, p in enumerate(PROMPTS, start=1)]
    write_parquet(tmp_path / "in.parquet", {"id": ["a", "b", "c", "d"], "prompt": prompts})
    out = tmp_path / "out"
    job = make_job(
        tiny_model_dir,
        str(tmp_path / "in.parquet"),
        out,
        sampling={"max_tokens": 6, "ignore_eos": True},
        engine={"backend": backend},
    )
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 0, text
    rows = _read(out).to_pylist()
    assert [r["input_tokens"] for r in rows] == [len(tok(p)["input_ids"]) for p in prompts]
    assert all(r["output_tokens"] == 6 and r["finish_reason"] == "length" for r in rows)
    manifest = json.loads((out / "_SUCCESS").read_text())
    assert manifest["tokens"]["input"] == sum(r["input_tokens"] for r in rows)
    assert manifest["tokens"]["output"] == 24
    assert manifest["backend"] == backend
    if backend == "hf":
        assert all(r["cached_tokens"] == 0 for r in rows)  # the hf backend has no prefix cache


@pytest.fixture(scope="module")
def metaspace_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a SentencePiece-style (Metaspace) tokenizer: its decoder drops the
    leading space of the first token decoded, so a completion's text depends on priming."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    lines = [" ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(12)) + "." for i in range(200)]
    backend.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>"]))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        clean_up_tokenization_spaces=False,
    )
    return save_tiny_llama(tmp_path_factory.mktemp("metaspace-llama"), tok)


@pytest.mark.parametrize("model_fixture", ["tiny_model_dir", "metaspace_model_dir"])
def test_backends_agree_and_native_serves_shared_prefixes_from_cache(
    tmp_path: Path, model_fixture: str, request: pytest.FixtureRequest
) -> None:
    tiny_model_dir = request.getfixturevalue(model_fixture)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    preamble = "once upon a time there was a little cat who liked to play in the sun. " * 4
    prompts = [preamble + p for p in PROMPTS] * 3
    write_parquet(tmp_path / "in.parquet", {"id": [str(i) for i in range(12)], "prompt": prompts})
    rows = {}
    for backend in ("hf", "native"):
        out = tmp_path / backend
        job = make_job(
            tiny_model_dir,
            str(tmp_path / "in.parquet"),
            out,
            sampling={"max_tokens": 10},
            engine={"backend": backend, "window_rows": 12, "block_size": 8},
        )
        code, text = _run(write_job(tmp_path / f"{backend}.yaml", job))
        assert code == 0, text
        rows[backend] = _read(out).to_pylist()
    for hf_row, native_row in zip(rows["hf"], rows["native"]):  # greedy: the same tokens either way
        assert native_row["generated_text"] == hf_row["generated_text"]
        assert native_row["output_tokens"] == hf_row["output_tokens"]
    if model_fixture == "metaspace_model_dir":  # the case that tells a primed stop checker from an unprimed one
        assert any(r["generated_text"].startswith(" ") for r in rows["hf"])
    shared_blocks = len(tok(preamble)["input_ids"]) // 8
    cached = [r["cached_tokens"] for r in rows["native"]]
    assert sum(c >= shared_blocks * 8 for c in cached) >= 11  # all but the first one computed
    assert all(c < r["input_tokens"] for c, r in zip(cached, rows["native"]))


def test_bad_rows_become_error_rows_and_the_job_goes_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    raw = [b"once upon a time", None, b"", b"   \n", b"bad \xff\xfe bytes", b"the cat " * 200, b"her friend"]
    offsets, buf = [0], b""
    for value in raw:
        buf += value or b""
        offsets.append(len(buf))
    prompts = pa.Array.from_buffers(  # bytes are not validated: a writer really can produce this
        pa.string(),
        len(raw),
        [pa.py_buffer(bytes([0b1111101])), pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]), pa.py_buffer(buf)],
    )
    table = pa.table({"id": [str(i) for i in range(7)], "prompt": prompts, "max_tokens": [4, 4, 4, 4, 4, 4, -3]})
    pq.write_table(table, tmp_path / "in.parquet")
    out = tmp_path / "out"
    job = make_job(
        tiny_model_dir, str(tmp_path / "in.parquet"), out, input={"sampling_columns": {"max_tokens": "max_tokens"}}
    )
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 0, text
    rows = _read(out).to_pylist()
    codes = [r["error_code"] for r in rows]
    assert codes == [
        None,
        "empty_prompt",
        "empty_prompt",
        "empty_prompt",
        "invalid_utf8",
        "prompt_too_long",
        "invalid_sampling",
    ]
    assert all(r["finish_reason"] == "error" and r["generated_text"] is None for r in rows[1:])
    assert "row 4 (id 4)" in rows[4]["error_message"] and "UTF-8" in rows[4]["error_message"]
    assert "401 tokens; the model's context is 256" in rows[5]["error_message"]
    assert all(r["input_tokens"] == r["output_tokens"] == 0 for r in rows[1:])  # nothing was billed
    assert "max_tokens" in rows[6]["error_message"]
    assert rows[4]["prompt"] == "bad \ufffd\ufffd bytes"  # carried, made readable
    assert json.loads((out / "_SUCCESS").read_text())["error_codes"]["empty_prompt"] == 3


def test_an_all_error_part_keeps_string_types(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_parquet(
        tmp_path / "a.parquet",
        {"id": ["1", "2"], "prompt": [None, " "]},
        pa.schema([("id", pa.string()), ("prompt", pa.string())]),
    )
    write_parquet(tmp_path / "b.parquet", {"id": ["3"], "prompt": ["the cat"]})
    out = tmp_path / "out"
    code, text = _run(write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(tmp_path / "*.parquet"), out)))
    assert code == 0, text
    first = pq.read_table(out / "part-000000.parquet")
    assert first.schema.field("generated_text").type == pa.string()
    assert first.schema.field("stop_reason").type == pa.string()
    assert _read(out).num_rows == 3


def test_chat_messages_are_rendered_with_the_template(tmp_path: Path, tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    convs = [
        [{"role": "user", "content": "tell me about the cat"}],
        [{"role": "system", "content": "be short"}, {"role": "user", "content": "a dog"}],
        [],
    ]
    write_parquet(tmp_path / "in.parquet", {"id": ["x", "y", "z"], "messages": convs})
    out = tmp_path / "out"
    job = make_job(tiny_model_dir, str(tmp_path / "in.parquet"), out)
    job["input"] = {"path": str(tmp_path / "in.parquet"), "messages_column": "messages", "id_column": "id"}
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 0, text
    rows = _read(out).to_pylist()
    expected = [
        len(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for c in convs[:2]
    ]
    assert [r["input_tokens"] for r in rows[:2]] == expected
    assert rows[2]["error_code"] == "empty_prompt"


def test_stop_strings_cut_the_text(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_parquet(tmp_path / "in.parquet", {"id": ["a", "b"], "prompt": PROMPTS[:2]})
    base = tmp_path / "base"
    job = make_job(tiny_model_dir, str(tmp_path / "in.parquet"), base, sampling={"max_tokens": 12, "ignore_eos": True})
    assert _run(write_job(tmp_path / "base.yaml", job))[0] == 0
    first = _read(base).to_pylist()[0]
    stop = first["generated_text"][3:5]  # a stop string that really occurs in the greedy output
    cut = tmp_path / "cut"
    job = make_job(
        tiny_model_dir,
        str(tmp_path / "in.parquet"),
        cut,
        sampling={"max_tokens": 12, "ignore_eos": True, "stop": [stop]},
    )
    assert _run(write_job(tmp_path / "cut.yaml", job))[0] == 0
    row = _read(cut).to_pylist()[0]
    assert row["finish_reason"] == "stop" and row["stop_reason"] == stop
    assert row["generated_text"] == first["generated_text"][: first["generated_text"].index(stop)]
    assert row["output_tokens"] <= first["output_tokens"]


def test_missing_column_fails_before_work_naming_file_and_column(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_parquet(tmp_path / "good.parquet", {"id": ["1"], "prompt": ["x"]})
    write_parquet(tmp_path / "bad.parquet", {"id": ["2"], "text": ["y"]})
    out = tmp_path / "out"
    job_path = write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(tmp_path / "*.parquet"), out))
    code, text = _run(job_path)
    assert code == 3
    assert "bad.parquet: no column 'prompt'" in text
    assert not out.exists()
    result = CliRunner().invoke(main, ["validate", str(job_path)])
    assert result.exit_code == 3 and "bad.parquet" in result.output


def test_validate_checks_model_folder_without_running(tmp_path: Path, tiny_model_dir: Path) -> None:
    write_parquet(tmp_path / "in.parquet", {"id": ["1"], "prompt": ["x"]})
    job_path = write_job(tmp_path / "job.yaml", make_job(tiny_model_dir, str(tmp_path / "in.parquet"), tmp_path / "o"))
    ok = CliRunner().invoke(main, ["validate", str(job_path)])
    assert ok.exit_code == 0 and "1 rows" in ok.output
    assert not (tmp_path / "o").exists()
    empty = tmp_path / "empty-model"
    empty.mkdir()
    bad = write_job(tmp_path / "bad.yaml", make_job(empty, str(tmp_path / "in.parquet"), tmp_path / "o"))
    result = CliRunner().invoke(main, ["validate", str(bad)])
    assert result.exit_code == 4 and "cannot load config.json" in result.output
    result = CliRunner().invoke(main, ["validate", str(job_path), "--set", "sampling.max_tokens=-1"])
    assert result.exit_code == 2 and "sampling.max_tokens" in result.output


def test_compile_auto_runs_a_small_job_eager_and_a_large_one_compiled(tmp_path: Path) -> None:
    """engine.compile "auto" in a job: compiling is worth it only over a long run (backends.for_rows)."""
    from batchgen.backends import COMPILE_MIN_ROWS, for_rows
    from batchgen.job.spec import load_job

    job = make_job(tmp_path, str(tmp_path / "in.parquet"), tmp_path / "out", engine={"backend": "native"})
    spec = load_job(write_job(tmp_path / "job.yaml", job))
    assert spec.engine.compile == "auto"
    assert for_rows(spec, COMPILE_MIN_ROWS - 1).engine.compile is False
    assert for_rows(spec, COMPILE_MIN_ROWS).engine.compile == "auto"  # the engine compiles where it wins (the CPU)
    chosen = load_job(write_job(tmp_path / "true.yaml", {**job, "engine": {"backend": "native", "compile": True}}))
    assert for_rows(chosen, 10).engine.compile is True
    assert spec.engine.compile == "auto"  # the job itself (and its fingerprint) is unchanged


def test_a_tiny_job_sizes_its_engine_for_its_own_sequences(tmp_path: Path) -> None:
    """A 3-row job does not get a KV pool and decode rows for 64 sequences (issue 28: time to first row)."""
    from batchgen.backends import SMALLEST_DEFAULT_SEQS, for_rows
    from batchgen.job.spec import load_job

    job = make_job(tmp_path, str(tmp_path / "in.parquet"), tmp_path / "out", engine={"backend": "native"})
    spec = load_job(write_job(tmp_path / "job.yaml", job))
    assert for_rows(spec, 3).engine.max_num_seqs == 3
    samples = load_job(write_job(tmp_path / "n.yaml", {**job, "sampling": {**job.get("sampling", {}), "n": 4}}))
    assert for_rows(samples, 3).engine.max_num_seqs == 12  # every sample is a sequence
    assert for_rows(spec, SMALLEST_DEFAULT_SEQS).engine.max_num_seqs is None  # the device's default
    chosen = load_job(write_job(tmp_path / "set.yaml", {**job, "engine": {"backend": "native", "max_num_seqs": 8}}))
    assert for_rows(chosen, 3).engine.max_num_seqs == 8  # an explicit value is kept
    assert spec.engine.max_num_seqs is None


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("cut", ["header", "data", "empty"])
def test_corrupt_weights_are_a_model_error_naming_the_file(
    tmp_path: Path, tiny_model_dir: Path, backend: str, cut: str
) -> None:
    """`truncate -s 1000 model.safetensors` in a copy of the model: exit 4, "weights cannot be
    loaded", naming the file; not exit 1 with the reader's traceback."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    weights = model / "model.safetensors"
    os.truncate(weights, {"header": 1000, "data": weights.stat().st_size - 100, "empty": 0}[cut])
    write_parquet(tmp_path / "in.parquet", {"id": ["1"], "prompt": ["once upon a time"]})
    job = make_job(model, str(tmp_path / "in.parquet"), tmp_path / "out", engine={"backend": backend})
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 4, text
    assert f"model.path {model}: weights cannot be loaded from model.safetensors: " in text
    assert "Traceback" not in text and "internal error" not in text


@pytest.mark.parametrize("size", [1000, 100, 0])
def test_a_corrupt_torch_checkpoint_is_a_model_error(tmp_path: Path, tiny_model_dir: Path, size: int) -> None:
    import torch
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(load_file(tiny_model_dir / "model.safetensors"), model / "pytorch_model.bin")
    os.truncate(model / "pytorch_model.bin", size)
    write_parquet(tmp_path / "in.parquet", {"id": ["1"], "prompt": ["once upon a time"]})
    job = make_job(model, str(tmp_path / "in.parquet"), tmp_path / "out", engine={"backend": "native"})
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 4 and f"model.path {model}: weights cannot be loaded from pytorch_model.bin" in text, text


def test_a_missing_shard_of_a_sharded_checkpoint_is_a_model_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(model, max_shard_size="100KB")
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) > 1 and (model / "model.safetensors.index.json").exists()
    shards[-1].unlink()
    write_parquet(tmp_path / "in.parquet", {"id": ["1"], "prompt": ["once upon a time"]})
    job = make_job(model, str(tmp_path / "in.parquet"), tmp_path / "out", engine={"backend": "hf"})
    code, text = _run(write_job(tmp_path / "job.yaml", job))
    assert code == 4 and f"weights cannot be loaded from {shards[-1].name}" in text, text
