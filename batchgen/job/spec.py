"""The job file: its schema, loading with line-aware errors, --set overrides, path resolution."""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, get_type_hints

import yaml
from pydantic import Field, PrivateAttr, ValidationError, create_model, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import SamplingParams, SettingError
from batchgen.errors import JobFileError
from batchgen.job.errors import ErrorKeys, Origins, describe, error_keys
from batchgen.job.parsing import DuplicateKey, ParsedYaml, apply_override, parse_yaml
from batchgen.job.pooling_section import PoolingSection, Task, task_errors
from batchgen.job.sections import (
    SCHEMA_COLUMN_KEY,
    ExecutorSection,
    InputSection,
    ModelSection,
    OutputSection,
    PricingSection,
    _Strict,
)
from batchgen.storage.uris import is_remote, local_path

# Settings the hf backend (transformers generate on static batches) refuses at load: generate has
# no cheap equivalent (penalties over generated tokens only, allowed ids, grammars), or each would
# need a second path through it (n samples, raw logprobs, prompt scoring); the native engine has them.
HF_UNSUPPORTED = (
    "n",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "allowed_token_ids",
    "structured",
)

# Where the job file's defaults differ from the engine's (SamplingParams, EngineConfig), on purpose.
# This is the only place they are stated; every other default comes from the engine's dataclasses.
JOB_DEFAULTS: dict[str, dict[str, Any]] = {
    "sampling": {
        "max_tokens": 128,  # why: vLLM's 16 cuts most answers short; a batch job wants whole answers
        "temperature": 0.0,  # why: a batch job is reproducible by default (greedy), not vLLM's 1.0
    },
}
# Engine settings the job file spells in other units: kv_cache_memory_mb (MiB, what people type)
# stands for EngineConfig.kv_cache_memory_bytes.
_JOB_SPELLED = {"kv_cache_memory_bytes": "kv_cache_memory_mb"}


def _derived_fields(cls: type, section: str) -> dict[str, Any]:
    """pydantic field definitions (type, default) for a dataclass's fields, with the job defaults."""
    hints = get_type_hints(cls)
    defaults = JOB_DEFAULTS.get(section, {})
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in _JOB_SPELLED or f.metadata.get("job") is False:  # Python-API-only settings (PYTHON_ONLY)
            continue
        if f.name in defaults:
            out[f.name] = (hints[f.name], defaults[f.name])
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = (hints[f.name], Field(default_factory=f.default_factory))
        else:
            out[f.name] = (hints[f.name], f.default)
    return out


def _not_job_keys(cls: type) -> dict[str, str]:
    """The dataclass's fields that are no job key (field metadata "job": False), each with what a job
    file does instead: a job that sets one is told so (job/errors), not just "unknown key"."""
    return {
        f.name: f.metadata.get("job_note", "a setting of the Python API (LLM, SamplingParams) only")
        for f in dataclasses.fields(cls)
        if f.metadata.get("job") is False
    }


def _setting_error(model: str, exc: SettingError, value: Any) -> ValidationError:
    """A dataclass's SettingError as a pydantic error located at its field (for key and line)."""
    kind = PydanticCustomError("setting", "must be {expected}", {"expected": exc.expected})
    return ValidationError.from_exception_data(model, [InitErrorDetails(type=kind, loc=(exc.field,), input=value)])


class _SamplingChecks(_Strict):
    not_job_keys: ClassVar[dict[str, str]] = _not_job_keys(SamplingParams)

    @model_validator(mode="after")
    def _check(self) -> _SamplingChecks:
        self.to_params()
        return self

    def to_params(self) -> SamplingParams:
        """The job-level SamplingParams: checked with the engine's own rules at load time."""
        values = self.model_dump()
        try:
            params = SamplingParams(**values)
        except SettingError as exc:
            raise _setting_error("SamplingSection", exc, values.get(exc.field)) from None
        if params.structured is not None:
            from batchgen.engine.sampling.structured import check_structured

            problem = check_structured(params.structured)
            if problem is not None:
                kind = PydanticCustomError("structured", "{problem}", {"problem": problem})
                details = [InitErrorDetails(type=kind, loc=("structured",), input=params.structured)]
                raise ValidationError.from_exception_data("SamplingSection", details)
        return params


if TYPE_CHECKING:  # why: the fields exist only at run time, taken from SamplingParams

    class SamplingSection(_SamplingChecks):
        def __getattr__(self, name: str) -> Any: ...

else:
    SamplingSection = create_model(
        "SamplingSection", __base__=_SamplingChecks, **_derived_fields(SamplingParams, "sampling")
    )


class _EngineChecks(_Strict):
    # Job-file-only settings: how rows reach the engine, not the engine itself.
    backend: Literal["native", "hf"] = "native"
    window_rows: int = Field(default=1024, ge=1)  # rows ordered together, then committed as one part
    ordering: Literal["prefix", "length", "none"] = "prefix"
    batch_size: int = Field(default=32, ge=1)  # hf backend: rows per static batch
    kv_cache_memory_mb: int | None = Field(default=None, ge=1)
    not_job_keys: ClassVar[dict[str, str]] = _not_job_keys(EngineConfig)

    @model_validator(mode="after")
    def _check(self) -> _EngineChecks:
        self.to_config()
        return self

    def engine_settings(self) -> dict[str, Any]:
        """Keyword settings for LLM(...) / EngineConfig(...): every EngineConfig field a job sets."""
        values = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(EngineConfig)
            if f.name not in _JOB_SPELLED and f.name not in self.not_job_keys
        }
        mb = self.kv_cache_memory_mb
        values["kv_cache_memory_bytes"] = mb * (1 << 20) if mb is not None else None
        return values

    def to_config(self) -> EngineConfig:
        values = self.engine_settings()
        try:
            return EngineConfig(**values)
        except SettingError as exc:
            field = _JOB_SPELLED.get(exc.field, exc.field)
            raise _setting_error("EngineSection", exc, getattr(self, field, None)) from None


if TYPE_CHECKING:  # why: the engine's fields exist only at run time, taken from EngineConfig

    class EngineSection(_EngineChecks):
        def __getattr__(self, name: str) -> Any: ...

else:
    EngineSection = create_model("EngineSection", __base__=_EngineChecks, **_derived_fields(EngineConfig, "engine"))


class JobSpec(_Strict):
    task: Task = "generate"  # embed | classify | score: a pooling job (job/pooling_section)
    model: ModelSection
    input: InputSection
    output: OutputSection
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    engine: EngineSection = Field(default_factory=EngineSection)
    pooling: PoolingSection | None = None  # task embed | classify | score only
    # Why excluded from dumps: prices change no generated text, so they stay out of the fingerprint.
    pricing: PricingSection | None = Field(default=None, exclude=True)
    # Why excluded too: where the parts run changes no output; a job started locally may resume on Ray.
    executor: ExecutorSection = Field(default_factory=ExecutorSection, exclude=True)
    source: Path | None = Field(default=None, exclude=True, strict=False)  # set by load_job
    _origins: Origins | None = PrivateAttr(default=None)  # set by load_job: where each value came from

    def where(self, dotted: str) -> str:
        """Where the value of `dotted` came from, for an error about it: `job.yaml:12`,
        `job.yaml (--set key=value)`, or the job file (a default)."""
        if self._origins is None:  # built in code, not loaded from a file
            return str(self.source or "the job")
        return self._origins.where(dotted)

    @model_validator(mode="before")
    @classmethod
    def _empty_sections(cls, data: Any) -> Any:
        """A section whose keys are all commented out reads as YAML null: it is an empty section
        (its defaults; a required key still reported missing). `pricing: null` already means no prices."""
        if not isinstance(data, dict):
            return data
        return {k: {} if v is None and k in _SECTIONS else v for k, v in data.items()}

    @model_validator(mode="after")
    def _task_keys(self) -> JobSpec:
        """Before any work: the job's keys fit its task (job/pooling_section)."""
        details = task_errors(self.task, self.pooling, self)
        if details:
            raise ValidationError.from_exception_data("JobSpec", details)
        return self

    @model_validator(mode="after")
    def _hf_features(self) -> JobSpec:
        """Before any work: the hf backend refuses the features transformers' generate lacks."""
        if self.engine.backend != "hf":
            return self
        defaults = SamplingParams()
        used: list[tuple[str, ...]] = [
            ("sampling", n) for n in HF_UNSUPPORTED if getattr(self.sampling, n) != getattr(defaults, n)
        ]
        columns = self.input.sampling_columns
        used += [("input", "sampling_columns", n) for n in columns if n in (*HF_UNSUPPORTED, SCHEMA_COLUMN_KEY)]
        if used:
            kind = PydanticCustomError(
                "hf_unsupported",
                "engine.backend hf does not support this setting (transformers' generate has no equivalent); "
                "use engine.backend native",
            )
            details = [InitErrorDetails(type=kind, loc=loc, input=None) for loc in used]
            raise ValidationError.from_exception_data("JobSpec", details)
        return self

    @model_validator(mode="after")
    def _tensor_parallel(self) -> JobSpec:
        """Before any work: a model split over N ranks runs on the native engine and generates (a
        pooling task runs on one device), and a Ray worker holds exactly its N GPUs (executor.worker_gpus)."""
        size, problems = self.engine.tensor_parallel_size, []
        if size > 1 and self.engine.backend != "native":
            problems.append((("engine", "backend"), f"tensor_parallel_size {size} needs engine.backend native"))
        if size > 1 and self.task != "generate":
            why = f"{size}: task {self.task} runs on one device (tensor parallelism serves task generate only); set 1"
            problems.append((("engine", "tensor_parallel_size"), why))
        gpus = self.executor.worker_gpus
        if gpus != size and (gpus > 1 or (self.executor.kind == "ray" and size > 1)):
            why = f"{gpus} GPUs per Ray worker must equal engine.tensor_parallel_size ({size})"
            problems.append((("executor", "worker_gpus"), why))
        if problems:
            details = [
                InitErrorDetails(type=PydanticCustomError("tensor_parallel", why), loc=loc, input=None)
                for loc, why in problems
            ]
            raise ValidationError.from_exception_data("JobSpec", details)
        return self

    @model_validator(mode="after")
    def _image_job(self) -> JobSpec:
        """Before any work: images are read by the native engine's generate task only."""
        if self.input.image_column is None:
            return self
        why = None
        if self.task != "generate":
            why = f"task {self.task} reads text only; images are for task generate"
        elif self.engine.backend != "native":
            why = "engine.backend hf does not read images; use engine.backend native"
        if why is not None:
            kind = PydanticCustomError("image_job", why)
            details = [InitErrorDetails(type=kind, loc=("input", "image_column"), input=self.input.image_column)]
            raise ValidationError.from_exception_data("JobSpec", details)
        return self

    @model_validator(mode="after")
    def _lora(self) -> JobSpec:
        """Before any work: adapters are served by the native engine's generation, and a lora
        column names adapters the job has (job/lora_keys)."""
        from batchgen.job.lora_keys import lora_errors

        details = lora_errors(self)
        if details:
            raise ValidationError.from_exception_data("JobSpec", details)
        return self


_SECTIONS = ("model", "input", "output", "sampling", "engine", "executor", "pooling")


def load_job(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read, override and validate a job file; relative paths resolve against its folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise JobFileError(f"{path}: cannot read the job file: {exc.strerror or exc}") from exc
    parsed = _parse_job_text(text, path)
    file_alone = copy.deepcopy(parsed.data)
    origins = Origins(path, parsed)  # why: an overridden value's error must cite --set, not the file's line
    for item in overrides or []:
        origins.overrides[apply_override(parsed.data, item, parsed)] = f"--set {item}"
    try:
        spec = JobSpec.model_validate(parsed.data)
    except ValidationError as exc:
        raise JobFileError(describe(exc, origins, functools.cache(lambda: _error_keys(file_alone)), JobSpec)) from None
    spec._origins = origins
    return _resolve_paths(spec, path)


def _error_keys(raw: dict[str, Any]) -> ErrorKeys:
    """The errors of the job file without its --set overrides."""
    try:
        JobSpec.model_validate(raw)
    except ValidationError as exc:
        return error_keys(exc)
    return set()


def _parse_job_text(text: str, path: Path) -> ParsedYaml:
    try:
        parsed = parse_yaml(text)
    except DuplicateKey as exc:
        raise JobFileError(f"{path}:{exc.line}: {exc}; YAML would keep only the last one: remove one") from None
    except yaml.YAMLError as exc:
        raise JobFileError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(parsed.data, dict):
        raise JobFileError(f"{path}: the job file must be a mapping with sections model, input, output, ...")
    return parsed


def _resolve_paths(spec: JobSpec, job_path: Path) -> JobSpec:
    base = job_path.resolve().parent
    spec.source = job_path.resolve()
    spec.model.path = (base / spec.model.path).resolve()
    spec.model.lora = {
        name: path if is_remote(path) else str((base / local_path(path)).resolve())
        for name, path in spec.model.lora.items()
    }
    if isinstance(spec.output.path, Path):  # an object-store URI stays as it is
        spec.output.path = (base / spec.output.path).resolve()
    spec.input.path = local_path(spec.input.path)
    if not is_remote(spec.input.path) and not Path(spec.input.path).is_absolute():
        spec.input.path = str(base / spec.input.path)
    return spec
