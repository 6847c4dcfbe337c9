"""How a model's hidden states become one vector (method, normalization, Matryoshka dimensions):
the caller's choices over a sentence-transformers folder's over the defaults, one rule for the
Python API and the job file; a call's own choices (PoolingParams, vLLM's shape) and what it gives
back per input (RowResult; the outputs users see are vLLM's shapes, made in vllm_compat/pooling.py).
Importable without torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # why: a type is all RowResult needs
    import torch

PoolingMethod = Literal["last", "mean", "cls"]
POOLING_METHODS: tuple[str, ...] = ("last", "mean", "cls")

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# sentence-transformers Pooling config keys -> our method; any other mode set is refused
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


class PoolingConfigError(ValueError):
    """A pooling setting or a sentence-transformers folder batchgen cannot follow (names the file / key)."""


@dataclass(frozen=True)
class PoolingConfig:
    method: PoolingMethod
    normalize: bool
    dimensions: int | None = None  # Matryoshka: keep the first `dimensions` values (then normalize)


@dataclass(frozen=True)
class PoolingParams:
    """Per-call pooling options: `dimensions` keeps the first D values of each embedding
    (Matryoshka models), `normalize` overrides the model's normalization (None: the model's)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be null or an integer >= 1, got {self.dimensions!r}")


@dataclass
class RowResult:
    """One input's result: embedding [D], probabilities [C] or a score [] (None: `error` says why)."""

    values: torch.Tensor | None
    cached_tokens: int = 0
    error: str | None = None


def resolve_pooling(
    model_path: str | Path, is_decoder: bool, method: str | None = None, normalize: bool | None = None
) -> PoolingConfig:
    """The pooling of `model_path` (defaults: decoder last token, encoder CLS, normalize true); an
    explicit `method` replaces the folder's Pooling module unchecked."""
    folder = read_sentence_transformers(Path(model_path), pooling_module=method is None)
    chosen = method or folder.get("method") or ("last" if is_decoder else "cls")
    if chosen not in POOLING_METHODS:
        raise PoolingConfigError(f"pooling method {chosen!r}: must be one of {', '.join(POOLING_METHODS)}")
    norm = normalize if normalize is not None else folder.get("normalize", True)
    return PoolingConfig(method=chosen, normalize=bool(norm))  # type: ignore[arg-type]


def read_sentence_transformers(folder: Path, pooling_module: bool = True) -> dict[str, Any]:
    """{"method": ..., "normalize": ...} from a folder's modules.json ({} without one); a module
    batchgen does not apply (Dense, max) is an error, never skipped."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return {}
    try:
        modules = json.loads(modules_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"{modules_file}: cannot read: {exc}") from exc
    found: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = module.get("type")
        if kind == _ST_TRANSFORMER:
            if module.get("path", "") not in ("", "."):
                raise PoolingConfigError(f"{modules_file}: the Transformer module must be the folder itself (path '')")
        elif kind == _ST_POOLING:
            if pooling_module:
                found["method"] = _st_pooling_method(folder / module.get("path", "1_Pooling") / "config.json")
        elif kind == _ST_NORMALIZE:
            found["normalize"] = True
        else:
            raise PoolingConfigError(f"{modules_file}: module type {kind!r} is not supported by batchgen")
    return found


def _st_pooling_method(config_file: Path) -> str:
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"{config_file}: cannot read: {exc}") from exc
    on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    if len(on) != 1 or on[0] not in _ST_MODES:
        raise PoolingConfigError(
            f"{config_file}: pooling modes {on} are not supported (one of {', '.join(_ST_MODES)} must be true)"
        )
    if on[0] == "pooling_mode_mean_tokens" and config.get("include_prompt", True) is False:
        raise PoolingConfigError(f"{config_file}: include_prompt false (instruction-excluded mean) is not supported")
    return _ST_MODES[on[0]]
