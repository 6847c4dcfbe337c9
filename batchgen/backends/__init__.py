"""Generation backends behind one interface: `native` (our engine) and `hf` (transformers generate)."""

from __future__ import annotations

from typing import Any

from batchgen.backends.base import Backend
from batchgen.job import JobSpec


def load_backend(spec: JobSpec, tokenizer: Any) -> Backend:
    if spec.engine.backend == "hf":
        from batchgen.backends.hf import HFBackend

        return HFBackend(spec, tokenizer)
    from batchgen.backends.native import NativeBackend

    return NativeBackend(spec, tokenizer)
