"""What an OpenAI batch request asks that only the job can judge: whether its endpoint is the job's
task (`/v1/embeddings` needs task embed; chat and completions need task generate), whether the
logprobs it asks for can be served (at most MAX_LOGPROBS, on the native engine: each row's own k is
computed for it, see prepare), and whether an embeddings request's `dimensions` is the job's.

Why apart from openai_requests.py: a line is parsed without the job; these rules read the job."""

from __future__ import annotations

import pyarrow as pa

from batchgen.engine.api.params import MAX_LOGPROBS
from batchgen.inputs.openai_requests import CHAT_URL, EMBEDDINGS_URL
from batchgen.job.spec import JobSpec


def request_problems(spec: JobSpec, table: pa.Table) -> list[tuple[str, str] | None]:
    """Per row: (error code, why) when the job cannot serve the request as asked, else None."""
    urls = table.column("url").to_pylist()
    asked = table.column("logprobs_requested").to_pylist()
    dimensions = table.column("dimensions").to_pylist()
    return [_problem(spec, url, k, d) for url, k, d in zip(urls, asked, dimensions)]


def _problem(spec: JobSpec, url: str | None, asked: int | None, dimensions: int | None) -> tuple[str, str] | None:
    if url is None:  # the line did not parse: its own problem is reported
        return None
    embeds = spec.task == "embed"
    if (url == EMBEDDINGS_URL) != embeds:
        need = "task: embed" if url == EMBEDDINGS_URL else "task: generate"
        return "unsupported_url", f"{url} needs {need}; this job's task is {spec.task}"
    if embeds:
        job = spec.pooling.dimensions if spec.pooling is not None else None
        if dimensions is not None and dimensions != job:
            said = "null (the model's full size)" if job is None else job
            return "unsupported_parameter", f"body.dimensions={dimensions}; the job's pooling.dimensions is {said}"
        return None
    if asked is None:
        return None
    field = "body.top_logprobs" if url == CHAT_URL else "body.logprobs"
    if asked > MAX_LOGPROBS:
        return "invalid_request", f"{field}={asked}: at most {MAX_LOGPROBS} top logprobs per token are served"
    if spec.engine.backend == "hf":
        return "unsupported_parameter", "logprobs need engine.backend native; this job runs the hf backend"
    return None
