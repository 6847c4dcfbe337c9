"""A JSONL input (with a bad line) and an OpenAI batch file on Ray workers: each worker reads its
own parts from their seek points, and the output equals a local run's, the OpenAI output file
included (written by the driver from the committed parts)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchgen.inputs import text_formats
from batchgen.job.spec import load_job
from batchgen.run.runner import JobRunner
from tests.conftest import make_job, output_table, write_job

WORDS = ["once", "upon", "a", "time", "the", "little", "cat", "dog", "played", "sun"]
COLUMNS = ["custom_id", "generated_text", "finish_reason", "error_code", "input_tokens", "output_tokens"]


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[Any]:
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


def _requests(path: Path) -> Path:
    lines = []
    for i in range(30):
        prompt = " ".join(WORDS[(i + j) % 10] for j in range(2 + i % 4))
        body = {"prompt": prompt, "max_tokens": 2 + i % 3}
        lines.append(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": body}))
    lines[17] = '{"custom_id": "broken", "url": '  # a bad line in a late part
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _job(tmp: Path, model: Path, name: str, executor: dict[str, Any] | None) -> Path:
    data = tmp / "requests.jsonl"
    if not data.exists():
        _requests(data)
    job = make_job(model, str(data), tmp / name, engine={"backend": "native", "window_rows": 4})
    job["input"] = {"path": str(data), "format": "openai_batch"}
    job["output"]["format"] = "openai_batch"
    if executor is not None:
        job["executor"] = executor
    return write_job(tmp / f"{name}.yaml", job)


def test_ray_workers_read_text_parts_from_seek_points(
    ray_instance: Any, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(text_formats, "INDEX_STRIDE", 5)  # seek points travel to the workers with the files
    JobRunner(load_job(_job(tmp_path, tiny_model_dir, "local", None)), quiet=True).run()
    ray = {"kind": "ray", "num_workers": 2, "worker_cpus": 1}
    JobRunner(load_job(_job(tmp_path, tiny_model_dir, "ray", ray)), quiet=True).run()
    local, remote = (output_table(tmp_path / n, COLUMNS) for n in ("local", "ray"))
    assert remote.to_pylist() == local.to_pylist()
    assert local.column("error_code").to_pylist()[17] == "invalid_json"
    out = [(tmp_path / n / "_batch_output.jsonl").read_text().splitlines() for n in ("local", "ray")]
    strip = [[{**json.loads(x), "id": None} for x in lines] for lines in out]  # ids follow the fingerprint
    for line in strip[0] + strip[1]:
        line["response"]["request_id"] = None
        if line["response"]["status_code"] == 200:
            line["response"]["body"].update(id=None, created=None)
    assert strip[0] == strip[1] and len(strip[0]) == 30
