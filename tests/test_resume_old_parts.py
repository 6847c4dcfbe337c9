"""Resuming an output whose committed parts an older batchgen wrote, with a narrower column type
(an OpenAI batch's carried `messages` before its `parts` field): the new parts are written in the
committed type, so the folder reads as one table and the output file equals a fresh run's; a type
that is not a narrower one is refused before any work, naming the column (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.outputs.part_record import PartFacts, describe_parts
from batchgen.storage.open import open_storage
from tests.conftest import make_job, write_job

OLD_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def requests(path: Path) -> Path:
    words = ["once upon a time", "the little cat", "her friend", "the sun", "a dog", "the big tree"]
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": w}], "max_tokens": 3}}
        for i, w in enumerate(words)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(tmp: Path, model: Path, out: Path) -> Any:
    job = make_job(model, str(requests(tmp / "requests.jsonl")), out, engine={"backend": "native", "window_rows": 2})
    job["input"] = {"path": str(tmp / "requests.jsonl"), "format": "openai_batch"}
    job["output"]["format"] = "openai_batch"
    job["sampling"] = {"max_tokens": 3, "temperature": 0.0}
    return CliRunner().invoke(main, ["run", str(write_job(tmp / "job.yaml", job)), "--quiet"])


def as_older_batchgen_left_it(out: Path, messages_type: pa.DataType) -> None:
    """Keep part 0 only, rewritten with `messages_type` (described in the record as an older
    batchgen described its parts), as a run stopped after its first part would have left it."""
    parts = sorted(out.glob("part-*.parquet"))
    table = pq.read_table(parts[0])
    index = table.schema.get_field_index("messages")
    table = table.set_column(index, pa.field("messages", messages_type), table.column("messages").cast(messages_type))
    pq.write_table(table, parts[0])
    describe_parts(open_storage(out), {parts[0].name: PartFacts.of(parts[0].read_bytes(), table.num_rows, 0)})
    for path in [*parts[1:], out / "_SUCCESS", out / "_batch_output.jsonl"]:
        path.unlink()


def test_a_resume_writes_the_committed_parts_narrower_type(tmp_path: Path, tiny_model_dir: Path) -> None:
    fresh = run(tmp_path, tiny_model_dir, tmp_path / "fresh")
    assert fresh.exit_code == 0, fresh.output
    out = tmp_path / "out"
    assert run(tmp_path, tiny_model_dir, out).exit_code == 0
    as_older_batchgen_left_it(out, OLD_MESSAGES)
    resumed = run(tmp_path, tiny_model_dir, out)
    assert resumed.exit_code == 0, resumed.output + repr(resumed.exception)
    parts = sorted(out.glob("part-*.parquet"))
    assert len(parts) == 3
    assert {str(pq.read_schema(p).field("messages").type.value_type) for p in parts} == {str(OLD_MESSAGES.value_type)}
    assert ds.dataset(out, format="parquet").to_table().num_rows == 6  # one schema: reads as one table
    lines = [json.loads(x) for x in (out / "_batch_output.jsonl").read_text().splitlines()]
    expected = [json.loads(x) for x in (tmp_path / "fresh" / "_batch_output.jsonl").read_text().splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["choices"]) for x in lines] == [
        (x["custom_id"], x["response"]["body"]["choices"]) for x in expected
    ]


def test_another_committed_type_is_refused_by_name(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = tmp_path / "out"
    assert run(tmp_path, tiny_model_dir, out).exit_code == 0
    other = pa.list_(pa.struct([("role", pa.string()), ("content", pa.large_string())]))
    as_older_batchgen_left_it(out, other)
    resumed = run(tmp_path, tiny_model_dir, out)
    assert resumed.exit_code == 2, resumed.output
    assert "the committed parts hold column 'messages' as" in resumed.output
    assert "--overwrite" in resumed.output
    assert len(list(out.glob("part-*.parquet"))) == 1  # nothing ran
