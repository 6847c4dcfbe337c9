"""Prefix grouping across the whole input (input.grouping): the plan is the same in every process
and stored once; grouped parts give the rows of an ungrouped job, `input_row` restores input
order, a resume after a kill takes the same parts, static shards take consecutive runs of whole
groups, an output made before plans resumes as it was made, and fewer prompt tokens are computed."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.inputs.reading import open_inputs
from batchgen.job.spec import load_job
from batchgen.outputs.plan_file import PLAN_NAME
from batchgen.run.layout import make_cut
from batchgen.usage.estimate import estimate_job, prefix_cache_hits
from tests.conftest import make_job, write_job, write_parquet

WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
DOCS, QUESTIONS = 16, 3  # 48 rows; window 6: each part holds two documents' questions
SAME = ["id", "generated_text", "finish_reason", "error_code", "input_tokens", "output_tokens"]
# A pool of 20 blocks of 16 tokens holds about 6 of the 16 documents (3 blocks each): an
# ungrouped job's parts evict the documents its later parts need again.
ENGINE = {"backend": "native", "window_rows": 6, "block_size": 16, "num_kv_blocks": 20, "max_num_seqs": 6}


def _rows_data(seed: int = 0) -> dict[str, list[Any]]:
    rng = random.Random(seed)
    docs = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(DOCS)]
    rows = [(d, q) for d in range(DOCS) for q in range(QUESTIONS)]
    rng.shuffle(rows)
    prompts = [f"{docs[d]} question {q}: {' '.join(WORDS[(d + q + j) % 10] for j in range(2 + q))}?" for d, q in rows]
    return {"id": [f"r{i}" for i in range(len(rows))], "prompt": prompts, "doc": [f"d{d}" for d, _ in rows]}


def _job(tmp_path: Path, model: Path, name: str, **input_section: Any) -> tuple[Path, Path]:
    data = tmp_path / "in.parquet"
    if not data.exists():
        write_parquet(data, _rows_data())
    out = tmp_path / name
    job = make_job(model, str(data), out, engine=ENGINE, input=input_section, sampling={"max_tokens": 6})
    return write_job(tmp_path / f"{name}.yaml", job), out


def _table(out: Path) -> Any:
    return ds.dataset(out, format="parquet").to_table()


def _same(out: Path) -> list[tuple[Any, ...]]:
    t = _table(out)
    return sorted(zip(*(t.column(c).to_pylist() for c in SAME)))


def _parts(out: Path) -> dict[int, list[int]]:
    """input_row of each committed part's rows."""
    return {
        int(p.name[5:11]): pq.read_table(p, columns=["input_row"]).column(0).to_pylist()
        for p in sorted(out.glob("part-*.parquet"))
    }


def _doc_of(tmp_path: Path) -> list[str]:
    return pq.read_table(tmp_path / "in.parquet", columns=["doc"]).column(0).to_pylist()


def _computed(out: Path) -> int:
    tokens = json.loads((out / "_SUCCESS").read_text())["tokens"]
    return int(tokens["input"] - tokens["cached"])


def _cli(job: Path, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_FAULT")}
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["BATCHGEN_FAULT"] = fault
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--quiet", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """The output of the ungrouped job (grouping: none) over this module's rows, run once in this
    process: the reference two tests compare grouped and resumed outputs with."""
    tmp = tmp_path_factory.mktemp("plain")
    job, out = _job(tmp, tiny_model_dir, "plain", grouping="none")
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_the_plan_is_deterministic_and_keeps_each_documents_rows_in_one_part(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    job, _ = _job(tmp_path, tiny_model_dir, "out")
    spec = load_job(job)
    files = open_inputs(spec.input.path, ["prompt"])
    cut = make_cut(spec, files)
    again = make_cut(spec, files)
    assert cut.rows.tolist() == again.rows.tolist() and cut.starts == again.starts
    assert sorted(cut.rows.tolist()) == list(range(DOCS * QUESTIONS))  # every row once
    doc = _doc_of(tmp_path)
    part_of = {r: p for p in range(len(cut.starts) - 1) for r in cut.rows[cut.starts[p] : cut.starts[p + 1]].tolist()}
    for d in set(doc):
        assert len({part_of[r] for r in range(len(doc)) if doc[r] == d}) == 1, d
    assert all(b - a <= ENGINE["window_rows"] for a, b in zip(cut.starts, cut.starts[1:]))
    # another process (another hash seed) makes the same plan
    code = (
        "import sys, json; from batchgen.job.spec import load_job; from batchgen.inputs.reading import open_inputs;"
        "from batchgen.run.layout import make_cut; s = load_job(sys.argv[1]);"
        "c = make_cut(s, open_inputs(s.input.path, ['prompt'])); print(json.dumps([c.rows.tolist(), c.starts]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run([sys.executable, "-c", code, str(job)], env=env, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [cut.rows.tolist(), cut.starts]


def test_grouped_rows_equal_ungrouped_rows_and_input_row_restores_input_order(
    tmp_path: Path, tiny_model_dir: Path, plain: Path
) -> None:
    grouped_job, grouped = _job(tmp_path, tiny_model_dir, "grouped")
    result = CliRunner().invoke(main, ["run", str(grouped_job), "--quiet"])
    assert result.exit_code == 0, result.output
    assert _same(grouped) == _same(plain)  # greedy: the same text for every row, whatever its part
    table = _table(grouped).sort_by("input_row")
    assert table.column("input_row").to_pylist() == list(range(DOCS * QUESTIONS))
    assert table.column("id").to_pylist() == [f"r{i}" for i in range(DOCS * QUESTIONS)]
    assert (grouped / PLAN_NAME).exists() and not (plain / PLAN_NAME).exists()
    assert json.loads((grouped / "_JOB.json").read_text())["grouping"] == {"mode": "auto"}
    # the prefix cache serves each document's blocks once per job, not once per part
    assert _computed(grouped) < _computed(plain)
    rows = sorted(zip(_doc_of(tmp_path), table.column("input_tokens").to_pylist(), range(DOCS * QUESTIONS)))
    ids = [load_tokenizer_ids(tiny_model_dir, _rows_data()["prompt"][r]) for _, _, r in rows]
    ideal = sum(len(i) for i in ids) - prefix_cache_hits(ids, 16)  # each shared block computed once
    assert _computed(grouped) <= ideal * 1.1 < _computed(plain)


def load_tokenizer_ids(model: Path, text: str) -> list[int]:
    from batchgen.inputs.prepare import load_tokenizer

    return list(load_tokenizer(model)(text)["input_ids"])


@pytest.mark.slow
def test_a_resume_after_a_kill_takes_the_same_parts(tmp_path: Path, tiny_model_dir: Path) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out")
    killed = _cli(job, fault="after_rename:2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    plan = (out / PLAN_NAME).read_bytes()
    first = _parts(out)
    assert len(first) == 2
    done = _cli(job)
    assert done.returncode == 0, done.stderr
    assert (out / PLAN_NAME).read_bytes() == plan
    parts = _parts(out)
    assert {p: parts[p] for p in first} == first  # committed parts kept as they were
    cut = pq.read_table(out / PLAN_NAME)
    by_part: dict[int, list[int]] = {}
    for p, r in zip(cut.column("part").to_pylist(), cut.column("input_row").to_pylist()):
        by_part.setdefault(p, []).append(r)
    assert {p: sorted(rows) for p, rows in parts.items()} == {p: sorted(rows) for p, rows in by_part.items()}


def test_static_shards_take_consecutive_runs_of_whole_groups(tmp_path: Path, tiny_model_dir: Path) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out")
    runner = CliRunner()
    taken: list[set[int]] = []
    for shard in ("0/2", "1/2"):
        before = set(_parts(out))
        result = runner.invoke(main, ["run", str(job), "--shard", shard, "--quiet"])
        assert result.exit_code == 0, result.output
        taken.append(set(_parts(out)) - before)
    parts = _parts(out)
    n = len(parts)
    assert taken[0] == set(range(len(taken[0]))) and taken[1] == set(range(len(taken[0]), n))  # consecutive runs
    assert sorted(r for rows in parts.values() for r in rows) == list(range(DOCS * QUESTIONS))  # every row once
    doc = _doc_of(tmp_path)
    shard_of = {r: s for s, mine in enumerate(taken) for p in mine for r in parts[p]}
    for d in set(doc):
        assert len({shard_of[r] for r in range(len(doc)) if doc[r] == d}) == 1, d
    assert (out / "_SUCCESS").exists()


def test_group_column_keeps_each_value_in_one_part(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "in.parquet"
    rows = 24
    # every prompt different from its first token; the group column says which rows belong together
    prompts = [f"{WORDS[i % 10]} {WORDS[(i * 3) % 10]} {' '.join(WORDS[: 2 + i % 5])}" for i in range(rows)]
    write_parquet(
        data, {"id": [f"r{i}" for i in range(rows)], "prompt": prompts, "task": [f"t{i % 4}" for i in range(rows)]}
    )
    out = tmp_path / "out"
    job = make_job(tiny_model_dir, str(data), out, engine=ENGINE, input={"group_column": "task"})
    spec = load_job(write_job(tmp_path / "job.yaml", job))
    cut = make_cut(spec, open_inputs(spec.input.path, ["prompt"]))
    for p in range(len(cut.starts) - 1):
        members = cut.rows[cut.starts[p] : cut.starts[p + 1]].tolist()
        assert len({r % 4 for r in members}) == 1, members  # 6 rows of one task fill one part of 6


def test_estimate_reports_the_plans_cache_hits(tmp_path: Path, tiny_model_dir: Path) -> None:
    grouped_job, _ = _job(tmp_path, tiny_model_dir, "grouped")
    plain_job, _ = _job(tmp_path, tiny_model_dir, "plain", grouping="none")
    grouped, plain = estimate_job(load_job(grouped_job)), estimate_job(load_job(plain_job))
    assert grouped.input_tokens == plain.input_tokens
    assert grouped.shareable_tokens > plain.shareable_tokens
    assert (
        grouped.parts == len(make_cut(load_job(grouped_job), open_inputs(str(tmp_path / "in.parquet"), [])).starts) - 1
    )


@pytest.mark.slow
def test_an_output_made_before_plans_resumes_as_it_was_made(tmp_path: Path, tiny_model_dir: Path, plain: Path) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out")
    # what an older batchgen left: its record (no "grouping" key, no plan) and nothing committed yet
    assert _cli(job, fault="mid_engine:1").returncode == -signal.SIGKILL
    record = json.loads((out / "_JOB.json").read_text())
    del record["grouping"]
    (out / "_JOB.json").write_text(json.dumps(record))
    (out / PLAN_NAME).unlink()
    assert _cli(job, fault="after_rename:2").returncode == -signal.SIGKILL
    done = _cli(job)
    assert done.returncode == 0, done.stderr
    assert not (out / PLAN_NAME).exists() and "grouping" not in json.loads((out / "_JOB.json").read_text())
    assert "input_row" not in _table(out).schema.names  # every part as the older batchgen made them
    for i, part in enumerate(sorted(out.glob("part-*.parquet"))):  # contiguous windows of input rows
        ids = pq.read_table(part, columns=["id"]).column(0).to_pylist()
        assert ids == [f"r{k}" for k in range(i * 6, min(i * 6 + 6, DOCS * QUESTIONS))]
    assert _same(out) == _same(plain)


def test_a_kill_while_the_plan_is_written_leaves_no_plan_and_the_rerun_makes_it(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    job, out = _job(tmp_path, tiny_model_dir, "out")
    assert _cli(job, fault="plan_temp_write").returncode == -signal.SIGKILL
    assert not (out / PLAN_NAME).exists()
    done = _cli(job)
    assert done.returncode == 0, done.stderr
    assert (out / PLAN_NAME).exists() and not list(out.glob(".*.tmp"))
    assert sorted(_table(out).column("input_row").to_pylist()) == list(range(DOCS * QUESTIONS))


@pytest.mark.serial
@pytest.mark.slow
def test_ray_workers_cover_every_row_once_with_whole_groups(tmp_path: Path, tiny_model_dir: Path) -> None:
    import ray

    from batchgen.run.runner import JobRunner

    _job(tmp_path, tiny_model_dir, "unused")  # writes the input
    out = tmp_path / "out"
    job = make_job(tiny_model_dir, str(tmp_path / "in.parquet"), out, engine=ENGINE, sampling={"max_tokens": 6})
    job["executor"] = {"kind": "ray", "num_workers": 2, "worker_cpus": 1}
    spec = load_job(write_job(tmp_path / "ray.yaml", job))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        runner = JobRunner(spec, quiet=True)
        summary = runner.run()
        stats = runner.executor.stats if runner.executor is not None else None
    finally:
        ray.shutdown()
    assert summary.manifest["rows"]["total"] == DOCS * QUESTIONS
    parts = _parts(out)
    assert sorted(r for rows in parts.values() for r in rows) == list(range(DOCS * QUESTIONS))
    assert stats is not None and sorted(i for done in stats.parts for i in done) == sorted(parts)


def test_ray_queue_keeps_a_group_on_one_worker_and_steals_whole_groups() -> None:
    import numpy as np

    from batchgen.inputs.part_rows import GroupedPart
    from batchgen.run.executors.part_queue import PartQueue

    # groups: [0], [1 2 3], [4], [5 6], [7]  (a joined part continues the previous part's group)
    joined = [False, False, True, True, False, False, True, False]
    parts = [GroupedPart(i, np.array([i]), j) for i, j in enumerate(joined)]
    queue = PartQueue(parts, 2)
    assert [[p.index for p in run] for run in queue.runs] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # not cut inside 1-3
    taken: dict[int, list[int]] = {0: [], 1: []}
    for _ in range(3):  # worker 1 is fast: it empties its run and steals
        taken[1].append(queue.next_for(1).index)  # type: ignore[union-attr]
    taken[0].append(queue.next_for(0).index)  # type: ignore[union-attr]
    while (part := queue.next_for(1)) is not None:
        taken[1].append(part.index)
    assert taken == {0: [0], 1: [4, 5, 6, 7, 1, 2, 3]}  # the last group 1-3 stolen whole, in order


def test_groups_span_files_and_each_row_keeps_its_row_id(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = _rows_data(seed=3)
    folder = tmp_path / "in"
    folder.mkdir()
    half = len(data["id"]) // 2
    for name, rows in (("a.jsonl", range(half)), ("b.jsonl", range(half, len(data["id"])))):
        lines = [json.dumps({"prompt": data["prompt"][i], "doc": data["doc"][i]}) for i in rows]
        (folder / name).write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    job = make_job(tiny_model_dir, str(folder), out, engine=ENGINE, sampling={"max_tokens": 2})
    job["input"].pop("id_column")  # row_id: "<file>:<row in that file>"
    job["input"]["format"] = "jsonl"
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output
    table = _table(out).sort_by("input_row")
    expected = [f"a.jsonl:{i}" for i in range(half)] + [f"b.jsonl:{i}" for i in range(len(data["id"]) - half)]
    assert table.column("row_id").to_pylist() == expected  # every row once, named by its own file
    assert table.column("doc").to_pylist() == data["doc"]
    for doc in set(data["doc"]):  # a document's questions in both files still share one part
        rows = {r for r, d in enumerate(data["doc"]) if d == doc}
        assert sum(1 for part in _parts(out).values() if rows & set(part)) == 1, doc


def test_a_long_shared_system_prompt_does_not_make_one_group_of_every_row(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = _rows_data(seed=5)
    system = " ".join(WORDS * 8)  # 80 words, several blocks: in every row, after the chat template's header
    messages = [
        [{"role": "system", "content": system}, {"role": "user", "content": prompt}] for prompt in data["prompt"]
    ]
    path = write_parquet(tmp_path / "chat.parquet", {"id": data["id"], "messages": messages})
    job = make_job(tiny_model_dir, str(path), tmp_path / "out", engine=ENGINE)
    job["input"] = {"path": str(path), "messages_column": "messages", "id_column": "id"}
    spec = load_job(write_job(tmp_path / "job.yaml", job))
    cut = make_cut(spec, open_inputs(spec.input.path, ["messages"]))
    part_of = {r: p for p in range(len(cut.starts) - 1) for r in cut.rows[cut.starts[p] : cut.starts[p + 1]].tolist()}
    for doc in set(data["doc"]):  # the key goes on past the shared header: each document's rows together
        assert len({part_of[r] for r, d in enumerate(data["doc"]) if d == doc}) == 1, doc
    assert not any(cut.joined)  # no group is larger than a part: the header is every row's, not a group


def test_prefix_ordering_inside_a_part_skips_the_header_every_row_shares() -> None:
    from batchgen.inputs.ordering import order_requests

    header = list(range(100, 180))  # 80 tokens every prompt starts with: more than the 64 the order looks at
    docs = {"a": [1] * 40, "b": [2] * 40}
    rows = [("a", 3), ("b", 9), ("a", 7), ("b", 1), ("a", 5)]  # (document, question length)
    prompts = [header + docs[d] + [7] * n for d, n in rows]
    order = order_requests(prompts, "prefix")
    assert [rows[i][0] for i in order] == ["a", "a", "a", "b", "b"]  # each document's rows together


UNIQUE_STARTS = (
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"  # one byte-level token each: no two rows share a block past the header
)


def _unique_prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"{UNIQUE_STARTS[i]} {' '.join(rng.choice(WORDS) for _ in range(20))}" for i in range(count)]


def test_unique_prompts_under_a_chat_template_keep_input_order(tmp_path: Path, tiny_model_dir: Path) -> None:
    rows = len(UNIQUE_STARTS)
    system = " ".join(WORDS * 8)  # a header of several blocks every row has: the floor, not a group
    messages = [
        [{"role": "system", "content": system}, {"role": "user", "content": p}] for p in _unique_prompts(rows, 1)
    ]
    path = write_parquet(tmp_path / "chat.parquet", {"id": [f"r{i}" for i in range(rows)], "messages": messages})
    job = make_job(tiny_model_dir, str(path), tmp_path / "out", engine=ENGINE)
    job["input"] = {"path": str(path), "messages_column": "messages", "id_column": "id"}
    spec = load_job(write_job(tmp_path / "job.yaml", job))
    cut = make_cut(spec, open_inputs(spec.input.path, ["messages"]))
    assert cut.rows.tolist() == list(range(rows))  # nothing shared: every part a contiguous run of the input
    assert cut.starts == list(range(0, rows, ENGINE["window_rows"])) + [rows] and not any(cut.joined)


def test_only_rows_that_share_a_prefix_move(tmp_path: Path, tiny_model_dir: Path) -> None:
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(4)]
    shared = [f"{docs[d]} question {q}: {WORDS[q]}?" for d in range(4) for q in range(3)]  # 12 rows, 4 documents
    prompts = [(p, f"d{i // 3}") for i, p in enumerate(shared)] + [(p, "-") for p in _unique_prompts(18, 2)]
    rng.shuffle(prompts)
    doc = [d for _, d in prompts]
    data = {"id": [f"r{i}" for i in range(len(prompts))], "prompt": [p for p, _ in prompts]}
    out = tmp_path / "out"
    job = make_job(tiny_model_dir, str(write_parquet(tmp_path / "in.parquet", data)), out, engine=ENGINE)
    spec = load_job(write_job(tmp_path / "job.yaml", job))
    cut = make_cut(spec, open_inputs(spec.input.path, ["prompt"]))
    parts = [cut.rows[a:b].tolist() for a, b in zip(cut.starts, cut.starts[1:])]
    for d in {d for d in doc if d != "-"}:  # a document's rows together
        assert sum(1 for part in parts if any(doc[r] == d for r in part)) == 1, d
    singles = [r for r, d in enumerate(doc) if d == "-"]
    assert cut.rows[12:].tolist() == singles  # the unshared rows after the grouped ones, in input order
    assert [len(part) for part in parts if doc[part[0]] == "-"] == [6, 6, 6]  # in contiguous window-sized runs
    assert all(doc[r] != "-" for part in parts[: len(parts) - 3] for r in part)


@pytest.mark.parametrize("run_bytes", [1 << 30, 200])
def test_the_sorted_keys_can_be_read_twice(tmp_path: Path, run_bytes: int) -> None:
    from batchgen.inputs.key_sort import KeySorter

    rng = random.Random(0)
    keys = [bytes(rng.randrange(4) for _ in range(8 * rng.randrange(1, 3))) for _ in range(50)]
    sorter = KeySorter(str(tmp_path), run_bytes=run_bytes)
    sorter.add(keys[:20], 0)
    sorter.add(keys[20:], 20)
    first = list(sorter.merged())
    assert first == sorted(zip(keys, range(50))) and list(sorter.merged()) == first
    assert bool(sorter.runs) == (run_bytes == 200)


def test_a_group_value_no_other_row_has_keeps_input_order(tmp_path: Path) -> None:
    from batchgen.inputs.grouping import group_key
    from batchgen.inputs.key_sort import KeySorter, plan_parts

    groups = ["t1", "a", "t2", "b", "t1", "c", "t2", "d"]  # a, b, c, d: one row each
    sorter = KeySorter(str(tmp_path))
    sorter.add([group_key(g) + bytes([i]) * 8 for i, g in enumerate(groups)], 0)
    cut = plan_parts(sorter, 2)
    parts = [cut.rows[a:b].tolist() for a, b in zip(cut.starts, cut.starts[1:])]
    assert sorted(parts[:2]) == [[0, 4], [2, 6]]  # each shared value's rows in one part
    assert parts[2:] == [[1, 3], [5, 7]] and cut.joined == [False] * 4  # the rest in input order


def test_a_row_that_is_no_request_does_not_make_a_group_of_the_header(tmp_path: Path) -> None:
    from batchgen.inputs.key_sort import NO_REQUEST, KeySorter, plan_parts

    header = b"H" * 16  # two blocks every keyed row starts with
    keys = [header + bytes([i]) * 8 for i in range(7)]
    keys[3] = NO_REQUEST  # a row that is no request (a bad row) shares nothing with any row
    sorter = KeySorter(str(tmp_path))
    sorter.add(keys, 0)
    cut = plan_parts(sorter, 3)
    assert cut.rows.tolist() == list(range(7)) and cut.starts == [0, 3, 6, 7]
