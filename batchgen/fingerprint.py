"""A job's fingerprint: what its output depends on (settings, model files, input files)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from batchgen.dataset import InputFile
from batchgen.job import JobSpec

_SMALL_FILE = 1 << 20  # model files up to this size are hashed whole; larger ones by size and edges


def job_fingerprint(spec: JobSpec, files: list[InputFile]) -> str:
    digest = hashlib.sha256()
    settings = spec.model_dump(mode="json", exclude={"output": True, "model": {"path"}, "input": {"path"}})
    digest.update(json.dumps(settings, sort_keys=True).encode())
    for path in sorted(p for p in Path(spec.model.path).rglob("*") if p.is_file()):
        digest.update(path.name.encode())
        digest.update(_file_digest(path))
    for f in files:
        digest.update(f.path.name.encode())
        digest.update(_file_digest(f.path))
    return digest.hexdigest()


def _file_digest(path: Path) -> bytes:
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with path.open("rb") as fh:
        if size <= _SMALL_FILE:
            h.update(fh.read())
        else:
            # Why: hashing gigabytes of weights on every run costs more than the check is worth;
            # size plus the first and last MiB catches any real change of checkpoint.
            h.update(fh.read(_SMALL_FILE))
            fh.seek(size - _SMALL_FILE)
            h.update(fh.read(_SMALL_FILE))
    return h.digest()
