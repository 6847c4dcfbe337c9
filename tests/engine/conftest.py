"""Tiny random-weight models of every supported architecture, saved like real HF folders.

2 layers, hidden 64, a 256-token word-level tokenizer whose id 0 is EOS; weights drawn with a large
initializer range so greedy logits are not near-tied. Sliding windows are small (<= 48) so that
300-token prompts really exercise them. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from testkit.tiny_models import save_random_model, tiny_configs


def failing_compiler(folder: Path, name: str) -> Path:
    """An executable `folder/name` that answers --version and fails every build with "fake: no luck"."""
    fake = folder / name
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo fake 1.0; exit 0; }\necho "fake: no luck" >&2; exit 1\n')
    fake.chmod(0o755)
    return fake


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "gpt_neox"]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model("llama") -> folder of a saved tiny model of that architecture (built once)."""
    built: dict[str, Path] = {}
    configs = tiny_configs()

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = save_random_model(configs[arch], tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get
