"""Object storage end to end against a real S3 API server on localhost (moto's threaded server):
a job reading Parquet from a bucket and writing to another prefix equals a local run, a kill -9
mid-run resumes to the same result, report and finalize work on s3:// URIs, and a bad URI,
option or bucket fails before any work. Credentials reach batchgen the standard way (AWS_*)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.errors import FingerprintMismatch, OutputError
from batchgen.inputs.objects import discover_objects
from batchgen.job.spec import load_job
from batchgen.outputs.state import OutputState
from batchgen.run.runner import JobRunner
from batchgen.storage import objectstore
from batchgen.storage.objectstore import ObjectStorage
from batchgen.storage.open import open_storage
from batchgen.storage.uris import check_storage_options, display_uri, options_from_uri
from tests.conftest import make_job, write_job, write_parquet
from tests.s3_server import moto_s3

WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
FILES = {"a.parquet": 10, "sub/b.parquet": 8}  # two input objects, one in a sub-prefix: keys differ
COLUMNS = ["row_id", "prompt", "generated_text", "finish_reason", "input_tokens", "cached_tokens", "output_tokens"]


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """One moto S3 server for the module; credentials in the environment, as a user would set them."""
    with moto_s3() as server:
        yield server


def _options(s3: dict[str, Any]) -> dict[str, str]:
    return {"endpoint_override": s3["endpoint"], "region": "us-east-1"}


def _prompts(n: int, shift: int) -> list[str]:
    return [" ".join(WORDS[(i + j + shift) % 10] for j in range(2 + i % 5)) for i in range(n)]


@pytest.fixture(scope="module")
def local_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("inputs")
    for k, (name, rows) in enumerate(FILES.items()):
        write_parquet(folder / name, {"prompt": _prompts(rows, k)})
    return folder


def _upload(s3: dict[str, Any], local: Path, prefix: str) -> str:
    for name in FILES:
        s3["fs"].create_dir(f"{prefix}/{name}".rsplit("/", 1)[0])
        with s3["fs"].open_output_stream(f"{prefix}/{name}") as out:
            out.write((local / name).read_bytes())
    return f"s3://{prefix}"


def _job(tmp: Path, model: Path, inputs: str, out: str, s3: dict[str, Any] | None) -> Path:
    job = make_job(model, inputs, Path("unused"), engine={"window_rows": 4}, sampling={"max_tokens": 6})
    job["input"]["id_column"] = None  # row_id = "<key>:<row>": the same keys on S3 as on disk
    job["output"]["path"] = out
    if s3 is not None:
        job["input"]["storage_options"] = _options(s3) if inputs.startswith("s3://") else {}
        job["output"]["storage_options"] = _options(s3)
    return write_job(tmp / f"job-{abs(hash(out))}.yaml", job)


def _rows(table: pa.Table) -> list[tuple[Any, ...]]:
    return sorted(zip(*(table.column(c).to_pylist() for c in COLUMNS)))


def _s3_rows(s3: dict[str, Any], prefix: str) -> list[tuple[Any, ...]]:
    return _rows(ds.dataset(prefix, format="parquet", filesystem=s3["fs"]).to_table())


def _read_json(s3: dict[str, Any], key: str) -> dict[str, Any]:
    with s3["fs"].open_input_stream(key) as stream:
        data: dict[str, Any] = json.loads(stream.read())
    return data


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, local_inputs: Path) -> dict[str, Any]:
    """An uninterrupted local run of the same job: rows, record and report."""
    tmp = tmp_path_factory.mktemp("local")
    job = _job(tmp, tiny_model_dir, str(local_inputs), str(tmp / "out"), None)
    result = CliRunner().invoke(main, ["run", str(job)])
    assert result.exit_code == 0, result.output
    report = CliRunner().invoke(main, ["report", str(tmp / "out"), "--json"])
    assert report.exit_code == 0, report.output
    return {
        "rows": _rows(ds.dataset(tmp / "out", format="parquet").to_table()),
        "record": json.loads((tmp / "out" / "_JOB.json").read_text()),
        "report": json.loads(report.stdout),
    }


def _without_path(report: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in report.items() if k not in ("path", "status")}


def test_a_job_from_a_bucket_to_a_bucket_equals_a_local_run(
    tmp_path: Path, tiny_model_dir: Path, s3: dict[str, Any], local_inputs: Path, reference: dict[str, Any]
) -> None:
    inputs = _upload(s3, local_inputs, "inputs/equal")
    job = str(_job(tmp_path, tiny_model_dir, inputs, "s3://outputs/equal", s3))
    checked = CliRunner().invoke(main, ["validate", job])
    assert checked.exit_code == 0 and "2 input file(s), 18 rows" in checked.stdout, checked.output
    estimate = CliRunner().invoke(main, ["estimate", job, "--json"])
    assert estimate.exit_code == 0 and json.loads(estimate.stdout)["rows"]["total"] == 18, estimate.output
    result = CliRunner().invoke(main, ["run", job])
    assert result.exit_code == 0, result.output
    assert _s3_rows(s3, "outputs/equal") == reference["rows"]  # rows, row_ids, texts, usage
    record = _read_json(s3, "outputs/equal/_JOB.json")
    assert record["id"] == reference["record"]["id"]  # keyed by relative key + content digest
    assert record["run"]["inputs"] == [f"{inputs}/{name}" for name in sorted(FILES)]
    assert "storage_options" not in json.dumps(record)  # how to reach the data (secrets) is not recorded
    manifest = _read_json(s3, "outputs/equal/_SUCCESS")
    assert manifest["rows"]["total"] == sum(FILES.values())
    query = "?endpoint_override=" + s3["endpoint"].removeprefix("http://") + "&scheme=http"
    report = CliRunner().invoke(main, ["report", f"s3://outputs/equal{query}", "--json"])
    assert report.exit_code == 0, report.output
    assert _without_path(json.loads(report.stdout)) == _without_path(reference["report"])
    assert "finished" in json.loads(report.stdout)["status"]


def _cli(job: Path, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_FAULT")}
    if fault:
        env["BATCHGEN_FAULT"] = fault
    cmd = [sys.executable, "-m", "batchgen", "run", str(job), "--quiet"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_temp_write:3"])  # part 3 serialized, never put
def test_killed_mid_run_resumes_to_the_local_result(
    tmp_path: Path,
    tiny_model_dir: Path,
    s3: dict[str, Any],
    local_inputs: Path,
    reference: dict[str, Any],
    point: str,
) -> None:
    prefix = f"inputs/kill-{point.replace(':', '-')}"
    inputs = _upload(s3, local_inputs, prefix)
    out = f"{prefix}/out"  # inside the input prefix: the resumed run must not read its parts as input
    job = _job(tmp_path, tiny_model_dir, inputs, f"s3://{out}", s3)
    killed = _cli(job, fault=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    selector = pafs.FileSelector(out, allow_not_found=True)
    kept = {i.base_name: i.mtime for i in s3["fs"].get_file_info(selector) if i.base_name.startswith("part-")}
    assert len(kept) == 2 and "_SUCCESS" not in {i.base_name for i in s3["fs"].get_file_info(selector)}
    resumed = _cli(job)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed: 2 part(s) kept" in resumed.stdout
    assert _s3_rows(s3, out) == reference["rows"]  # every row exactly once, equal to the local run
    now = {i.base_name: i.mtime for i in s3["fs"].get_file_info(selector)}
    assert all(now[name] == mtime for name, mtime in kept.items())  # committed parts not rewritten


def test_finalize_on_a_bucket(tmp_path: Path, tiny_model_dir: Path, s3: dict[str, Any], local_inputs: Path) -> None:
    inputs = _upload(s3, local_inputs, "inputs/final")
    job = _job(tmp_path, tiny_model_dir, inputs, "s3://outputs/final", s3)
    assert CliRunner().invoke(main, ["run", str(job)]).exit_code == 0
    written = _read_json(s3, "outputs/final/_SUCCESS")
    os.environ["AWS_ENDPOINT_URL"] = s3["endpoint"]  # the store's standard variable, read by pyarrow and boto3
    try:
        s3["fs"].delete_file("outputs/final/_SUCCESS")
        done = CliRunner().invoke(main, ["finalize", "s3://outputs/final"])
        assert done.exit_code == 0, done.output
        assert "s3://outputs/final finalized: 5 parts, 18 rows ok" in done.stdout
        assert _read_json(s3, "outputs/final/_SUCCESS")["rows"] == written["rows"]
        again = CliRunner().invoke(main, ["finalize", "s3://outputs/final"])
        assert again.exit_code == 0 and "already finalized" in again.stdout
        s3["fs"].delete_file("outputs/final/_SUCCESS")
        s3["fs"].delete_file("outputs/final/part-000003.parquet")
        missing = CliRunner().invoke(main, ["finalize", "s3://outputs/final"])
        assert missing.exit_code == 8 and "part-000003.parquet" in missing.stderr
    finally:
        del os.environ["AWS_ENDPOINT_URL"]


@pytest.mark.parametrize(
    ("where", "change", "code", "message"),
    [
        ("output", {"storage_options": {"endpont_override": "x"}}, 2, "unknown key 'endpont_override' for s3://"),
        ("input", {"storage_options": {"region": 3}}, 2, "input.storage_options.region: must be a string"),
        ("output", {"path": "hdfs://x/y", "storage_options": {}}, 2, "unsupported URI scheme hdfs://"),
        ("input", {"path": "ftp://x/y"}, 2, "input.path: unsupported URI scheme ftp://"),
        ("output", {"path": "s3:///nobucket"}, 2, "names no bucket"),
        ("input", {"path": "s3://no-such-bucket/data"}, 3, "bucket 'no-such-bucket' does not exist"),
        ("input", {"path": "s3://inputs/nothing-here"}, 3, "no Parquet objects found at s3://inputs/nothing-here"),
        ("output", {"path": "s3://no-such-bucket/out"}, 5, "bucket 'no-such-bucket' does not exist"),
    ],
)
def test_a_bad_uri_option_or_bucket_fails_before_any_work(
    tmp_path: Path,
    tiny_model_dir: Path,
    s3: dict[str, Any],
    local_inputs: Path,
    where: str,
    change: dict[str, Any],
    code: int,
    message: str,
) -> None:
    inputs = _upload(s3, local_inputs, "inputs/bad")
    job = make_job(tiny_model_dir, inputs, Path("unused"))
    job["input"].update(id_column=None, storage_options=_options(s3))
    job["output"] = {"path": "s3://outputs/bad", "storage_options": _options(s3)}
    job[where].update(change)
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job))])
    assert result.exit_code == code, result.output
    assert message in result.stderr
    assert s3["fs"].get_file_info(pafs.FileSelector("outputs/bad", allow_not_found=True)) == []


def test_storage_options_on_a_local_path_are_a_job_error(tmp_path: Path, tiny_model_dir: Path) -> None:
    job = make_job(tiny_model_dir, str(tmp_path / "in.parquet"), tmp_path / "out")
    job["output"]["storage_options"] = {"region": "us-east-1"}
    result = CliRunner().invoke(main, ["validate", str(write_job(tmp_path / "job.yaml", job))])
    assert result.exit_code == 2 and "output.storage_options: only for s3:// or gs:// paths" in result.stderr


@pytest.mark.parametrize("conditional", [True, False])
def test_a_committed_object_is_never_replaced(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch, conditional: bool
) -> None:
    uri = f"s3://outputs/never-{conditional}"
    if not conditional:  # without boto3: refused, unless a single writer is declared (then check-then-put)
        monkeypatch.setattr(objectstore, "missing_library", lambda store: "boto3")
        refused = ObjectStorage(uri, check_storage_options(uri, _options(s3), "output"))
        with pytest.raises(OutputError, match=r"need boto3.*set output.single_writer: true \(or pass --single-writer"):
            refused.prepare()
    store = ObjectStorage(uri, check_storage_options(uri, _options(s3), "output"), single_writer=not conditional)
    assert store.write_parquet("part-000000.parquet", pa.table({"x": [1]}), "after_temp_write")
    assert not store.write_parquet("part-000000.parquet", pa.table({"x": [2]}), "after_temp_write")
    assert store.read_table("part-000000.parquet", ["x"]).column("x").to_pylist() == [1]
    assert store.committed_parts() == {0: "part-000000.parquet"}


def _record(job: str) -> dict[str, Any]:
    return {"id": job, "settings": {}, "model": "m", "inputs": {}, "run": {"parts": 1, "started": 1.0}}


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("refresh", [False, True])  # a shard run, a plain run
def test_two_jobs_starting_at_once_cannot_both_claim_an_output(
    tmp_path: Path, s3: dict[str, Any], where: str, refresh: bool
) -> None:
    # the old record is of a job that committed nothing, so either job may take the output: not both
    out = str(tmp_path) if where == "local" else f"s3://outputs/claim-{refresh}"
    store = open_storage(out, None if where == "local" else _options(s3))
    old = OutputState(store)
    old.check_record(_record("old"))
    old.claim_record(_record("old"), refresh=True)
    first, second = OutputState(store), OutputState(store)
    assert not first.check_record(_record("a")) and not second.check_record(_record("b"))
    first.claim_record(_record("a"), refresh=refresh)
    with pytest.raises(FingerprintMismatch, match="another job claimed this output at the same time"):
        second.claim_record(_record("b"), refresh=refresh)
    assert (first.read_record() or {})["id"] == "a"


def test_a_record_write_landing_between_read_and_put_wins_on_s3(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = "s3://outputs/swap"
    store = ObjectStorage(uri, check_storage_options(uri, _options(s3), "output"))
    assert store.swap_text("_JOB.json", "old", None, "record_temp_write")
    assert not store.swap_text("_JOB.json", "new", None, "record_temp_write")  # there is one
    client = store._writer().client
    real_get = client.get_object

    def get_then_another_write_lands(**kwargs: Any) -> Any:
        got = real_get(**kwargs)
        client.put_object(Bucket=kwargs["Bucket"], Key=kwargs["Key"], Body=b"theirs")
        return got

    monkeypatch.setattr(client, "get_object", get_then_another_write_lands)
    assert not store.swap_text("_JOB.json", "mine", "old", "record_temp_write")  # If-Match: its ETag is gone
    assert store.read_text("_JOB.json") == "theirs"


def test_a_record_swap_retries_a_conflict(s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.exceptions import ClientError

    uri = "s3://outputs/swap-conflict"
    store = ObjectStorage(uri, check_storage_options(uri, _options(s3), "output"))
    assert store.swap_text("_JOB.json", "old", None, "record_temp_write")
    client = store._writer().client
    real_put, refused = client.put_object, []

    def put(**kwargs: Any) -> Any:
        if "IfMatch" in kwargs and not refused:  # 409: another conditional write of the key in flight
            refused.append(kwargs)
            error = {"Code": "ConditionalRequestConflict", "Message": "conflict"}
            raise ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": 409}}, "PutObject")
        return real_put(**kwargs)

    monkeypatch.setattr(client, "put_object", put)
    assert store.swap_text("_JOB.json", "mine", "old", "record_temp_write")
    assert refused and store.read_text("_JOB.json") == "mine"


@pytest.mark.parametrize("answer", ["NotImplemented", "ignored"])
def test_a_store_without_working_preconditions_is_refused_unless_single_writer(
    s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    from botocore.exceptions import ClientError

    uri = f"s3://outputs/no-if-match-{answer}"
    options = check_storage_options(uri, _options(s3), "output")
    stores = [ObjectStorage(uri, options), ObjectStorage(uri, options, single_writer=True)]
    for store in stores:
        client = store._writer().client
        real_put = client.put_object

        def put(real_put: Any = real_put, **kwargs: Any) -> Any:
            if "IfMatch" in kwargs:
                if answer == "NotImplemented":
                    raise ClientError({"Error": {"Code": answer, "Message": "no"}}, "PutObject")
                kwargs.pop("IfMatch")  # a store that ignores the header
            return real_put(**kwargs)

        monkeypatch.setattr(client, "put_object", put)
    with pytest.raises(OutputError, match=f"{uri}: the store (does not implement|ignores) If-Match"):
        stores[0].prepare()
    store = stores[1]
    store.prepare()  # logged, and compare-then-put from here on
    assert store.swap_text("_JOB.json", "old", None, "record_temp_write")
    assert store.swap_text("_JOB.json", "new", "old", "record_temp_write")
    assert not store.swap_text("_JOB.json", "newer", "old", "record_temp_write")
    assert store.read_text("_JOB.json") == "new"


def test_input_globs_and_prefixes_on_a_bucket(s3: dict[str, Any], local_inputs: Path) -> None:
    _upload(s3, local_inputs, "inputs/glob")
    pq.write_table(pa.table({"x": [1]}), "inputs/glob/.hidden.parquet", filesystem=s3["fs"])
    found = discover_objects(s3["fs"], "inputs/glob", "s3://inputs/glob", exclude=None)
    assert [key for _, key in found] == ["a.parquet", "sub/b.parquet"]
    star = discover_objects(s3["fs"], "inputs/glob/*.parquet", "s3://inputs/glob", exclude=None)
    assert star == [("inputs/glob/a.parquet", "a.parquet")]
    deep = discover_objects(s3["fs"], "inputs/glob/**/b.parquet", "s3://inputs/glob", exclude=None)
    assert [key for _, key in deep] == ["sub/b.parquet"]
    assert discover_objects(s3["fs"], "inputs/glob", "s3://inputs/glob", exclude="inputs/glob/sub") == [
        ("inputs/glob/a.parquet", "a.parquet")
    ]


def test_an_older_output_inside_an_input_prefix_is_not_read_as_input(s3: dict[str, Any], local_inputs: Path) -> None:
    _upload(s3, local_inputs, "inputs/nested")
    for name in ("_JOB.json", "part-000000.parquet"):  # an older run's output, left under the input prefix
        with s3["fs"].open_output_stream(f"inputs/nested/old_out/{name}") as out:
            out.write(b"{}")
    found = discover_objects(s3["fs"], "inputs/nested", "s3://inputs/nested", exclude=None)
    assert [key for _, key in found] == ["a.parquet", "sub/b.parquet"]
    glob = discover_objects(s3["fs"], "inputs/nested/**/*.parquet", "s3://inputs/nested", exclude=None)
    assert [key for _, key in glob] == ["a.parquet", "sub/b.parquet"]
    named = discover_objects(s3["fs"], "inputs/nested/old_out", "s3://inputs/nested/old_out", exclude=None)
    assert [key for _, key in named] == ["part-000000.parquet"]  # named as the input: read on purpose


def test_storage_options_are_normalized_and_checked_per_store() -> None:
    assert check_storage_options("s3://b/p", {"endpoint_override": "http://h:9000"}, "output") == {
        "endpoint_override": "h:9000",
        "scheme": "http",
    }
    with pytest.raises(ValueError, match="endpoint_override is http:// but scheme is https"):
        check_storage_options("s3://b/p", {"endpoint_override": "http://h:9000", "scheme": "https"}, "output")
    with pytest.raises(ValueError, match=r"unknown key 'region' for gs:// \(known: anonymous, endpoint_override"):
        check_storage_options("gs://b/p", {"region": "x"}, "input")
    with pytest.raises(ValueError, match="anonymous: must be true or false"):
        check_storage_options("s3://b/p", {"anonymous": "yes"}, "input")
    uri, options = options_from_uri("s3://b/p/?endpoint_override=h:1&scheme=http&anonymous=true", None, "output")
    assert (uri, options) == ("s3://b/p", {"endpoint_override": "h:1", "scheme": "http", "anonymous": True})


@pytest.mark.slow
def test_ray_workers_read_and_commit_on_a_bucket(
    tmp_path: Path, tiny_model_dir: Path, s3: dict[str, Any], local_inputs: Path, reference: dict[str, Any]
) -> None:
    # Why: a Ray worker rebuilds the storage from the pickled PartWriter/InputFiles in its own
    # process (no shared file system); its rows must land on the bucket exactly as a local run's.
    import ray

    inputs = _upload(s3, local_inputs, "inputs/ray")
    job = _job(tmp_path, tiny_model_dir, inputs, "s3://outputs/ray", s3)
    spec = load_job(job, ["executor.kind=ray", "executor.num_workers=2", "executor.worker_cpus=1"])
    # started here, after the fixture set the AWS_* variables, so the workers inherit them
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        summary = JobRunner(spec, quiet=True).run()
    finally:
        ray.shutdown()
    assert summary.totals.ok_rows == sum(FILES.values())
    skip = COLUMNS.index("cached_tokens")  # which worker's cache a part hits is not fixed
    assert [r[:skip] + r[skip + 1 :] for r in _s3_rows(s3, "outputs/ray")] == [
        r[:skip] + r[skip + 1 :] for r in reference["rows"]
    ]
    assert _read_json(s3, "outputs/ray/_SUCCESS")["rows"]["total"] == sum(FILES.values())


def _objects(s3: dict[str, Any], prefix: str) -> dict[str, bytes]:
    infos = s3["fs"].get_file_info(pafs.FileSelector(prefix, allow_not_found=True))
    found = {}
    for info in infos:
        with s3["fs"].open_input_stream(info.path) as stream:
            found[info.base_name] = stream.read()
    return found


def test_overwrite_on_a_bucket_keeps_the_old_output_until_the_new_job_can_run(
    tmp_path: Path, tiny_model_dir: Path, s3: dict[str, Any], local_inputs: Path
) -> None:
    inputs = _upload(s3, local_inputs, "inputs/overwrite")
    job = _job(tmp_path, tiny_model_dir, inputs, "s3://outputs/overwrite", s3)
    assert CliRunner().invoke(main, ["run", str(job), "--quiet"]).exit_code == 0
    before = _objects(s3, "outputs/overwrite")
    assert {"_SUCCESS", "_JOB.json", "part-000004.parquet"} <= set(before)
    weightless = tmp_path / "weightless"
    shutil.copytree(tiny_model_dir, weightless, ignore=shutil.ignore_patterns("*.safetensors"))
    args = ["run", str(job), "--quiet", "--overwrite", "--set", f"model.path={weightless}"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 4, result.output
    assert _objects(s3, "outputs/overwrite") == before
    args = ["run", str(job), "--quiet", "--overwrite", "--set", "sampling.max_tokens=2"]
    assert CliRunner().invoke(main, args).exit_code == 0
    after = _objects(s3, "outputs/overwrite")
    assert after["_JOB.json"] != before["_JOB.json"] and set(after) == set(before)


SECRET = "s3cr3t-never-shown-9f2c"


def _batchgen(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGEN_FAULT")}
    cmd = [sys.executable, "-m", "batchgen", *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_no_printed_or_logged_uri_shows_a_secret_from_its_query(
    tmp_path: Path, tiny_model_dir: Path, s3: dict[str, Any], local_inputs: Path
) -> None:
    """Credentials in a URI's query (`?access_key=..&secret_key=..`) never reach stdout, stderr or
    the logs of run, validate, estimate, report and finalize, on success or on error; nor the
    objects batchgen writes (Airflow keeps task logs)."""
    query = f"?endpoint_override={s3['endpoint']}&region=us-east-1&access_key=testing&secret_key={SECRET}"
    inputs = _upload(s3, local_inputs, "inputs/secret") + query
    out = "s3://outputs/secret" + query
    job = make_job(tiny_model_dir, inputs, Path("unused"), engine={"window_rows": 4}, sampling={"max_tokens": 4})
    job["input"]["id_column"] = None
    job["output"]["path"] = out
    job_file = write_job(tmp_path / "job.yaml", job)
    calls: list[tuple[tuple[str | Path, ...], int]] = [
        (("run", job_file), 0),  # INFO logs, the progress bar and the summary lines
        (("run", job_file), 0),  # nothing to do
        (("run", job_file, "--set", "sampling.max_tokens=3"), 2),  # refused: names the output
        (("validate", job_file), 0),
        (("estimate", job_file), 0),
        (("estimate", job_file, "--json"), 0),
        (("report", out), 0),
        (("report", out, "--json"), 0),
        (("report", out, "--csv"), 0),
        (("report", out, "--html", tmp_path / "report.html"), 0),
        (("finalize", out), 0),
        (("finalize", "s3://outputs/nothing-here" + query), 3),
        (("report", "s3://no-such-bucket/x" + query), 3),
    ]
    stdout: dict[tuple[str | Path, ...], str] = {}
    for args, code in calls:
        done = _batchgen(*args)
        assert done.returncode == code, (args, done.stderr)
        assert SECRET not in done.stdout + done.stderr, args
        stdout[args] = done.stdout
    assert "s3://outputs/secret" in stdout[("finalize", out)]  # the URI is shown, without its query
    assert SECRET not in (tmp_path / "report.html").read_text()
    for name in ("_JOB.json", "_SUCCESS"):
        with s3["fs"].open_input_stream(f"outputs/secret/{name}") as stream:
            assert SECRET not in stream.read().decode()


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (f"s3://b/run?access_key=AK&secret_key={SECRET}", "s3://b/run"),
        (f"s3://AK:{SECRET}@b/run/", "s3://b/run"),
        (f"gs://b/run#{SECRET}", "gs://b/run"),
        (f"file:///data/out?{SECRET}", "file:///data/out"),
        ("/data/what?.parquet", "/data/what?.parquet"),  # a local path: "?" is part of the name
    ],
)
def test_display_uri_is_the_one_redaction(uri: str, shown: str) -> None:
    assert display_uri(uri) == shown
