"""Tiny random-weight vision-language models saved with their processor files (testkit/tiny_vision)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from testkit.tiny_vision import save_tiny_vlm


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_vlm("llava") -> folder of a saved tiny VLM of that family (built once per session)."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = save_tiny_vlm(family, tmp_path_factory.mktemp(f"tiny-vlm-{family}"))
        return built[family]

    return get
