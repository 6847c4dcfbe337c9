"""A moto S3 server on localhost for tests, with credentials in the environment as a user would set
them, and the buckets `inputs` and `outputs`. Shared by the object-store test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow.fs as pafs


@contextmanager
def moto_s3() -> Iterator[dict[str, Any]]:
    """{"endpoint": "http://127.0.0.1:PORT", "fs": a pyarrow S3FileSystem on it}."""
    from moto.server import ThreadedMotoServer

    saved = dict(os.environ)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        fs = pafs.S3FileSystem(
            endpoint_override=f"{host}:{port}", scheme="http", region="us-east-1", allow_bucket_creation=True
        )
        for bucket in ("inputs", "outputs"):
            fs.create_dir(bucket)
        yield {"endpoint": f"http://{host}:{port}", "fs": fs, "host": host, "port": port}
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)


def options(s3: dict[str, Any], endpoint: str | None = None) -> dict[str, str]:
    return {"endpoint_override": endpoint or s3["endpoint"], "region": "us-east-1"}
