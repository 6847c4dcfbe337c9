"""`import vllm` -> batchgen: module aliases in sys.modules, and the `vllm` version clients ask for.

Why a version at all: clients branch on `importlib.metadata.version("vllm")` (lm-evaluation-harness
checks it when its vLLM backend is imported), and with no distribution named vllm that call
raises. A meta-path finder answers for the name "vllm" only (it never lists itself among all
distributions), with VLLM_API_VERSION: the vLLM release whose offline API this mirrors
(`SamplingParams(structured_outputs=StructuredOutputsParams(...))`, `llm_engine.model_config`).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from importlib.abc import MetaPathFinder
from importlib.metadata import Distribution
from pathlib import Path
from types import ModuleType
from typing import Any

VLLM_API_VERSION = "0.34.0"  # the vLLM release on PyPI when this was last checked against it

# vLLM's module -> ours (the names clients import from; see the package docstring)
ALIASES = {
    "vllm": "batchgen.vllm_compat",
    "vllm.attention": "batchgen.vllm_compat.platforms",
    "vllm.attention.backends": "batchgen.vllm_compat.platforms",
    "vllm.attention.backends.registry": "batchgen.vllm_compat.platforms",
    "vllm.config": "batchgen.vllm_compat.platforms",
    "vllm.engine": "batchgen.vllm_compat.engine_args",
    "vllm.engine.arg_utils": "batchgen.vllm_compat.engine_args",
    "vllm.entrypoints": "batchgen.vllm_compat.chat_utils",
    "vllm.entrypoints.chat_utils": "batchgen.vllm_compat.chat_utils",
    "vllm.entrypoints.llm": "batchgen.vllm_compat.llm",
    "vllm.inputs": "batchgen.vllm_compat.inputs",
    "vllm.lora": "batchgen.vllm_compat.lora",
    "vllm.lora.request": "batchgen.vllm_compat.lora",
    "vllm.outputs": "batchgen.vllm_compat.outputs",
    "vllm.platforms": "batchgen.vllm_compat.platforms",
    "vllm.pooling_params": "batchgen.engine.pooling.config",
    "vllm.sampling_params": "batchgen.engine.api.params",
    "vllm.tokenizers": "batchgen.vllm_compat.tokenizers",
    "vllm.transformers_utils": "batchgen.vllm_compat.tokenizers",
    "vllm.transformers_utils.tokenizer": "batchgen.vllm_compat.tokenizers",
    "vllm.utils": "batchgen.vllm_compat.argparse_utils",
    "vllm.utils.argparse_utils": "batchgen.vllm_compat.argparse_utils",
    "vllm.utils.print_utils": "batchgen.vllm_compat.print_utils",
    "vllm.v1": "batchgen.vllm_compat.platforms",
    "vllm.v1.attention": "batchgen.vllm_compat.platforms",
    "vllm.v1.attention.backends": "batchgen.vllm_compat.platforms",
    "vllm.v1.attention.backends.registry": "batchgen.vllm_compat.platforms",
}


class _VllmDistribution(Distribution):
    """Metadata of the name "vllm": this package, at VLLM_API_VERSION."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_API_VERSION}\nSummary: batchgen's vLLM API\n"
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)


class _VllmFinder(MetaPathFinder):
    """Finds no modules (sys.modules holds the aliases); finds the "vllm" distribution by name."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        return None

    def find_distributions(self, context: Any = None) -> Iterator[Distribution]:
        name = getattr(context, "name", None) or ""
        if name.lower().replace("-", "_").replace(".", "_") == "vllm":
            yield _VllmDistribution()


_FINDER = _VllmFinder()
_SET: list[str] = []  # the submodule attributes install() set on the top package (removed by uninstall)


def install() -> None:
    """Make `import vllm...` resolve to batchgen (see ALIASES). Refused where a real vLLM is imported."""
    present = sys.modules.get("vllm")
    if present is not None and present.__name__ != ALIASES["vllm"]:
        where = getattr(present, "__file__", None) or repr(present)
        raise RuntimeError(f"a real vllm module is already imported ({where}); batchgen's aliases would shadow it")
    for alias, target in ALIASES.items():
        sys.modules[alias] = importlib.import_module(target)
    top = sys.modules["vllm"]
    for alias in ALIASES:  # why: `import vllm.pooling_params` then reads `vllm.pooling_params`
        name = alias.removeprefix("vllm.")
        if "." not in name and alias != "vllm" and not hasattr(top, name):
            setattr(top, name, sys.modules[alias])
            _SET.append(name)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def uninstall() -> None:
    """Remove every alias install() made (and the version answer)."""
    top = sys.modules.get("vllm")
    while _SET:
        name = _SET.pop()
        if top is not None and hasattr(top, name):
            delattr(top, name)
    for alias, target in ALIASES.items():
        module: ModuleType | None = sys.modules.get(alias)
        if module is not None and module.__name__ == target:
            del sys.modules[alias]
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


__all__ = ["ALIASES", "VLLM_API_VERSION", "install", "uninstall"]
