"""An object-store LoRA adapter is fetched to the local cache once and reused while the store lists
it unchanged; a changed object is fetched again. Counted on the real moto S3 server: its request
recording (moto's own API) shows each GET of the weights."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from batchgen.job.adapter_fetch import SETTLE_S, fetch_adapter
from tests.s3_server import moto_s3

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "lora" / "storyteller"
WEIGHTS = "adapter_model.safetensors"


def _call(endpoint: str, action: str) -> str:
    method = "GET" if action == "download-recording" else "POST"
    request = urllib.request.Request(f"{endpoint}/moto-api/recorder/{action}", method=method, data=None)
    with urllib.request.urlopen(request) as answer:
        return str(answer.read().decode())


def _weight_gets(endpoint: str) -> int:
    """GETs of the weight file since the last call (the recording is then emptied)."""
    lines = [json.loads(line) for line in _call(endpoint, "download-recording").splitlines() if line.strip()]
    _call(endpoint, "reset-recording")
    return sum(1 for r in lines if r["method"] == "GET" and r["url"].split("?")[0].endswith(WEIGHTS))


def test_a_remote_adapter_is_fetched_again_only_when_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # moto writes its recording to the working folder
    with moto_s3() as s3:
        fs, endpoint = s3["fs"], s3["endpoint"]

        def put(name: str, data: bytes) -> None:
            with fs.open_output_stream(f"inputs/adapters/story/{name}") as out:
                out.write(data)

        weights = (SAMPLE / WEIGHTS).read_bytes()
        put("adapter_config.json", (SAMPLE / "adapter_config.json").read_bytes())
        put(WEIGHTS, weights)
        time.sleep(SETTLE_S + 0.2)  # the listing settles (see adapter_fetch)
        uri = f"s3://inputs/adapters/story?endpoint_override={s3['host']}:{s3['port']}&scheme=http&region=us-east-1"
        _call(endpoint, "reset-recording")
        _call(endpoint, "start-recording")
        first = fetch_adapter("story", uri)
        assert _weight_gets(endpoint) == 1 and (first / WEIGHTS).read_bytes() == weights
        assert fetch_adapter("story", uri) == first  # unchanged in the store: the cached copy
        assert _weight_gets(endpoint) == 0
        changed = weights[:-4] + bytes(b ^ 0xFF for b in weights[-4:])  # the same size: the last weights' bytes
        put(WEIGHTS, changed)
        second = fetch_adapter("story", uri)
        assert _weight_gets(endpoint) == 1 and second != first and (second / WEIGHTS).read_bytes() == changed
        # written within SETTLE_S of this listing: a same-size rewrite in the same second would list
        # alike, so that listing is not trusted and the next run fetches once more
        assert fetch_adapter("story", uri) == second and _weight_gets(endpoint) == 1
        time.sleep(SETTLE_S + 0.2)
        assert fetch_adapter("story", uri) == second and _weight_gets(endpoint) == 1  # settled: noted now
        assert fetch_adapter("story", uri) == second and _weight_gets(endpoint) == 0
        assert (first / WEIGHTS).read_bytes() == weights  # the old copy stands apart (content-addressed)
