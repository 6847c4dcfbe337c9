"""The job file: its schema, loading with line-aware errors, --set overrides, path resolution."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from batchgen.errors import JobFileError

SAMPLING_OVERRIDABLE = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens")


class _Strict(BaseModel):
    # An unknown key is an error, and "1" is not silently an int: a typo must never be ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelSection(_Strict):
    path: Path = Field(strict=False)
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"


class InputSection(_Strict):
    path: str  # a Parquet file, a folder of them, or a glob
    prompt_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    carry_columns: list[str] | None = None  # None: carry every input column
    sampling_columns: dict[str, str] = Field(default_factory=dict)  # SamplingParams field -> column
    limit: int | None = Field(default=None, ge=1)  # only the first N rows (quick trials)

    @model_validator(mode="after")
    def _one_prompt_source(self) -> "InputSection":
        if (self.prompt_column is None) == (self.messages_column is None):
            raise ValueError("set exactly one of input.prompt_column or input.messages_column")
        for name in self.sampling_columns:
            if name not in SAMPLING_OVERRIDABLE:
                raise ValueError(
                    f"input.sampling_columns: {name!r} cannot be set per row "
                    f"(allowed: {', '.join(SAMPLING_OVERRIDABLE)})"
                )
        return self


class OutputSection(_Strict):
    path: Path = Field(strict=False)


class SamplingSection(_Strict):
    max_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True


class EngineSection(_Strict):
    backend: Literal["native", "hf"] = "native"
    window_rows: int = Field(default=1024, ge=1)  # rows ordered together, then committed as one part
    ordering: Literal["prefix", "length", "none"] = "prefix"
    batch_size: int = Field(default=32, ge=1)  # hf backend: rows per static batch
    block_size: int = Field(default=16, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    kv_cache_memory_mb: int | None = Field(default=None, ge=1)
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(default=None, ge=1)


class PricingSection(_Strict):
    """Prices in any currency per million tokens, read by `estimate` and `report` only."""

    input: Decimal | None = Field(default=None, ge=0, strict=False, allow_inf_nan=False)
    cached_input: Decimal | None = Field(default=None, ge=0, strict=False, allow_inf_nan=False)
    output: Decimal | None = Field(default=None, ge=0, strict=False, allow_inf_nan=False)


class JobSpec(_Strict):
    model: ModelSection
    input: InputSection
    output: OutputSection
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    # Why excluded from dumps: prices change no generated text, so they stay out of the fingerprint.
    pricing: PricingSection | None = Field(default=None, exclude=True)
    source: Path | None = Field(default=None, exclude=True, strict=False)  # set by load_job


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read, override and validate a job file; relative paths resolve against its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read the job file: {exc.strerror or exc}") from exc
    raw, lines = _parse_yaml(text, path)
    for item in overrides or []:
        _apply_override(raw, item)
    try:
        spec = JobSpec.model_validate(raw)
    except ValidationError as exc:
        raise JobFileError(_describe(exc, path, lines)) from None
    return _resolve_paths(spec, path)


def _parse_yaml(text: str, path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise JobFileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise JobFileError(f"{path}: the job file must be a mapping with sections model, input, output, ...")
    return raw, _key_lines(node)


def _key_lines(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Map each dotted key path to its 1-based line in the YAML text."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            dotted = f"{prefix}{key_node.value}"
            lines[dotted] = key_node.start_mark.line + 1
            lines.update(_key_lines(value_node, dotted + "."))
    return lines


def _apply_override(raw: dict[str, Any], item: str) -> None:
    """Apply one `section.key=value` override; the value is parsed as YAML (64, 0.7, [a, b])."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise JobFileError(f"--set {item!r}: expected section.key=value")
    parts = key.strip().split(".")
    target = raw
    for part in parts[:-1]:
        child = target.setdefault(part, {})
        if not isinstance(child, dict):
            raise JobFileError(f"--set {item!r}: {part!r} is not a section")
        target = child
    try:
        target[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise JobFileError(f"--set {item!r}: value is not valid YAML: {exc}") from None


def _describe(exc: ValidationError, path: Path, lines: dict[str, int]) -> str:
    problems = []
    for err in exc.errors():
        dotted = ".".join(str(p) for p in err["loc"])
        line = _nearest_line(dotted, lines)
        where = f"{path}:{line}" if line else str(path)
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        problems.append(f"{where}: {dotted}: {msg}")
    return "invalid job file:\n  " + "\n  ".join(problems)


def _nearest_line(dotted: str, lines: dict[str, int]) -> int | None:
    parts = dotted.split(".")
    while parts:
        line = lines.get(".".join(parts))
        if line is not None:
            return line
        parts.pop()
    return None


def _resolve_paths(spec: JobSpec, job_path: Path) -> JobSpec:
    base = job_path.resolve().parent
    spec.source = job_path.resolve()
    spec.model.path = (base / spec.model.path).resolve()
    spec.output.path = (base / spec.output.path).resolve()
    if not Path(spec.input.path).is_absolute():
        spec.input.path = str(base / spec.input.path)
    return spec
