"""The device rooms have one door: nothing in the package but engine/platforms.py imports
engine/cpu or engine/cuda (everything else asks the device's Platform), and each device's
Platform answers for it."""

from __future__ import annotations

import ast
from pathlib import Path

from batchgen.engine.api.platform import Platform
from batchgen.engine.platforms import platform_for

PACKAGE = Path(__file__).resolve().parents[2] / "batchgen"
DEVICE_ROOMS = ("batchgen.engine.cpu", "batchgen.engine.cuda")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def test_only_the_platforms_module_imports_the_device_rooms() -> None:
    door = PACKAGE / "engine" / "platforms.py"
    inside = [PACKAGE / "engine" / "cpu", PACKAGE / "engine" / "cuda"]
    leaks = {
        str(path.relative_to(PACKAGE.parent)): sorted(n for n in _imports(path) if n.startswith(DEVICE_ROOMS))
        for path in PACKAGE.rglob("*.py")
        if path != door and not any(path.is_relative_to(room) for room in inside)
    }
    assert {path: names for path, names in leaks.items() if names} == {}


def test_each_device_gets_its_own_answers() -> None:
    cpu, cuda, mps = (platform_for(name) for name in ("cpu", "cuda", "mps"))
    assert type(mps) is Platform and mps.attention_backend("auto") == "torch" and mps.greedy_ids() is None
    assert cpu.attention_backend("auto") == "cpu" and cpu.greedy_ids() is not None
    assert cuda.memory_probe() is not None and cpu.memory_probe() is None and mps.memory_probe() is None
    assert (cpu.max_num_seqs, cuda.max_num_seqs) == (64, 256)
    assert cpu.facts()["kernels"] and mps.facts() == {}
