"""The job file's plain sections: model, input, output, pricing, executor.

Why apart from spec.py: these sections check their own keys and need nothing from the engine's
dataclasses; spec.py derives the `sampling` and `engine` sections from SamplingParams and
EngineConfig, assembles the JobSpec and loads job files.
"""

from __future__ import annotations

import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from batchgen.engine.api.config import DEVICE_CHOICES, DEVICE_NAME
from batchgen.storage.uris import check_storage_options, is_remote, local_path

SAMPLING_OVERRIDABLE = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",  # a list of strings (or one string) per row
)
# A per-row column that is not a SamplingParams number: JSON schema text, one row's structured output.
SCHEMA_COLUMN_KEY = "json_schema"


class _Strict(BaseModel):
    # An unknown key is an error, and "1" is not silently an int: a typo must never be ignored.
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelSection(_Strict):
    path: Path = Field(strict=False)
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # LoRA adapters: name -> PEFT folder (local, resolved against the job file's folder; or an
    # s3:// / gs:// URI, fetched to a local cache). Rows pick one by name (input.lora_column).
    lora: dict[str, str] = Field(default_factory=dict)

    @field_validator("lora")
    @classmethod
    def _adapter_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not ADAPTER_NAME.fullmatch(name):
                raise PydanticCustomError(
                    "adapter_name",
                    "adapter name {name} must be letters, digits, '.', '_', '-' or '/' (a row names it)",
                    {"name": repr(name)},
                )
            if not path.strip():
                raise PydanticCustomError("adapter_path", "model.lora.{name}: empty path", {"name": name})
            check_storage_options(path, {}, f"model.lora.{name}")  # an unsupported scheme or no bucket fails here
        return value

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        if not DEVICE_NAME.fullmatch(value):
            context = {"choices": DEVICE_CHOICES, "value": repr(value)}
            raise PydanticCustomError("device", "must be {choices}, got {value}", context)
        return value


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")

# What an OpenAI batch file's rows are made of (batchgen/inputs/openai_requests.py): set by the format.
_OPENAI_SET = ("prompt_column", "messages_column", "id_column", "sampling_columns")


class InputSection(_Strict):
    path: str  # a file, a folder of them, or a glob; or an s3:// / gs:// URI of one
    # auto: a `datasets` folder by its state files, else by extension (.jsonl, .csv, .parquet), else Parquet
    format: Literal["auto", "parquet", "jsonl", "csv", "hf_dataset", "openai_batch"] = "auto"
    storage_options: dict[str, Any] = Field(default_factory=dict)  # object stores: endpoint, region, keys

    prompt_column: str | None = None  # None: "prompt", unless messages_column is set
    messages_column: str | None = None
    id_column: str | None = None
    carry_columns: list[str] | None = None  # None: carry every input column
    sampling_columns: dict[str, str] = Field(default_factory=dict)  # SamplingParams field -> column
    limit: int | None = Field(default=None, ge=1)  # only the first N rows (quick trials)
    # auto: parts follow the prefix plan (rows sharing a prompt prefix together, batchgen.inputs.grouping);
    # none: parts are contiguous row ranges in input order
    grouping: Literal["auto", "none"] = "auto"
    group_column: str | None = None  # rows with equal values here are grouped first (grouping: auto)
    lora_column: str | None = None  # the row's adapter, a name in model.lora (null or empty: the base model)

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputSection:
        self.storage_options = check_storage_options(self.path, self.storage_options, "input")
        if self.format == "openai_batch":
            self._openai_columns()
        if self.prompt_column is not None and self.messages_column is not None:
            raise ValueError("set exactly one of input.prompt_column or input.messages_column")
        if self.group_column is not None and self.grouping == "none":
            raise ValueError("input.group_column groups rows only with input.grouping: auto")
        if self.messages_column is None and self.prompt_column is None:
            self.prompt_column = "prompt"
        for name in self.sampling_columns:
            if name not in (*SAMPLING_OVERRIDABLE, SCHEMA_COLUMN_KEY):
                raise ValueError(
                    f"input.sampling_columns: {name!r} cannot be set per row "
                    f"(allowed: {', '.join((*SAMPLING_OVERRIDABLE, SCHEMA_COLUMN_KEY))})"
                )
        # why not for OpenAI batch files: only the requests with a response_format need xgrammar; without
        # it those are error rows (invalid_structured, naming the install), not a refused job
        if SCHEMA_COLUMN_KEY in self.sampling_columns and self.format != "openai_batch":
            from batchgen.engine.sampling.structured import StructuredError, load_xgrammar

            try:  # why here: without xgrammar every row would fail one by one
                load_xgrammar()
            except StructuredError as exc:
                raise ValueError(f"input.sampling_columns.{SCHEMA_COLUMN_KEY}: {exc}") from None
        return self

    def _openai_columns(self) -> None:
        from batchgen.inputs.openai_requests import SAMPLING_COLUMNS

        chosen = [k for k in _OPENAI_SET if getattr(self, k)]
        if self.lora_column is not None:
            chosen.append("lora_column (a request's body.model names its adapter)")
        if chosen and (self.prompt_column, self.id_column) != ("prompt", "custom_id"):  # (a re-validated dump)
            raise ValueError(f"input.format openai_batch sets {', '.join(chosen)} itself; remove them")
        self.prompt_column, self.id_column = "prompt", "custom_id"
        self.sampling_columns = {**SAMPLING_COLUMNS, SCHEMA_COLUMN_KEY: "json_schema"}


class OutputSection(_Strict):
    path: Path | str  # a local folder (made a Path), or an s3:// / gs:// URI (kept as text)
    storage_options: dict[str, Any] = Field(default_factory=dict)
    # Object stores only: true declares that one run at a time writes this output, so a store
    # without conditional writes may be used (check-then-put); the run lock still stands.
    single_writer: bool = False
    # openai_batch: also write `_batch_output.jsonl`, the OpenAI batch output file, when the job completes
    format: Literal["parquet", "openai_batch"] = "parquet"
    # auto: split a reasoning model's <think>...</think> into reasoning_text / reasoning_tokens
    reasoning: Literal["auto", "none"] = "none"

    @field_validator("path")
    @classmethod
    def _local_as_path(cls, path: Path | str) -> Path | str:
        check_storage_options(path, {}, "output")  # an unsupported scheme or no bucket fails here
        return path if isinstance(path, Path) or is_remote(path) else Path(local_path(path))

    @model_validator(mode="after")
    def _options(self) -> OutputSection:
        self.storage_options = check_storage_options(self.path, self.storage_options, "output")
        return self


class AdapterPrices(_Strict):
    """One LoRA adapter's own prices; a price not given is the job's (pricing.input, ...)."""

    input: Decimal | None = Field(default=None, ge=0, strict=False, allow_inf_nan=False)
    cached_input: Decimal | None = Field(default=None, ge=0, strict=False, allow_inf_nan=False)
    output: Decimal | None = Field(default=None, ge=0, strict=False, allow_inf_nan=False)


class PricingSection(AdapterPrices):
    """Prices in any currency per million tokens, read by `estimate` and `report` only."""

    lora: dict[str, AdapterPrices] = Field(default_factory=dict)  # adapter name (model.lora) -> its prices


class ExecutorSection(_Strict):
    """Where the parts run: this process (`local`) or engine workers on Ray (`ray`); see
    batchgen/executors. The `ray` keys are read only with kind ray."""

    kind: Literal["local", "ray"] = "local"
    address: str | None = None  # null: start a local Ray instance; "auto", "ray://host:port" or "host:port": join one
    num_workers: int | None = Field(default=None, ge=1)  # null: one per GPU in the cluster (no GPU: 1)
    # GPUs per worker: 1, or engine.tensor_parallel_size (a placement group per worker holds them together)
    worker_gpus: int = Field(default=1, ge=0)
    worker_cpus: float | None = Field(default=None, gt=0)  # null: 1 with a GPU, else the cluster's CPUs / workers

    @field_validator("address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None and not _RAY_ADDRESS.fullmatch(value):
            raise PydanticCustomError(
                "address", "must be null, auto, ray://host:port or host:port, got {value}", {"value": repr(value)}
            )
        return value


_RAY_ADDRESS = re.compile(r"auto|(ray://)?[\w.\-]+:\d+")
