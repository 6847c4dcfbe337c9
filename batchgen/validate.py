"""Checks that run before any work: the columns a job reads, the columns it carries, and that the
model folder has a loadable config and tokenizer (without loading weights)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.dataset import InputFile, open_inputs
from batchgen.errors import InputDataError, ModelError
from batchgen.job import JobSpec
from batchgen.output import RESULT_NAMES, ROW_ID_COLUMN
from batchgen.prepare import check_sampling_columns

log = logging.getLogger(__name__)


def input_columns(spec: JobSpec) -> list[str]:
    """Columns the job must read from every input file."""
    i = spec.input
    names = [i.prompt_column or i.messages_column, i.id_column, *i.sampling_columns.values()]
    return [n for n in dict.fromkeys(names) if n is not None]


def carried_columns(spec: JobSpec, schema: pa.Schema) -> list[str]:
    """Input columns copied into the output; they must not collide with the result columns."""
    wanted = spec.input.carry_columns if spec.input.carry_columns is not None else list(schema.names)
    if spec.input.id_column and spec.input.id_column not in wanted:
        wanted = [spec.input.id_column, *wanted]  # why: an output row must say which input row it is
    missing = [c for c in wanted if c not in schema.names]
    if missing:
        raise InputDataError(f"input.carry_columns: no such column(s) {missing} (columns: {', '.join(schema.names)})")
    reserved = set(RESULT_NAMES) | ({ROW_ID_COLUMN} if spec.input.id_column is None else set())
    clash = [c for c in wanted if c in reserved]
    if clash:
        raise InputDataError(
            f"input columns {clash} collide with batchgen's output columns; leave them out with input.carry_columns"
        )
    return wanted


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(f"model.path {model_path}: cannot load a tokenizer: {exc}") from exc


def check_model_folder(model_path: Path) -> Any:
    """The model's config and tokenizer load; weights are not touched. Returns the config."""
    from transformers import AutoConfig

    if not model_path.is_dir():
        raise ModelError(f"model.path {model_path}: no such folder")
    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path {model_path}: cannot load config.json: {exc}") from exc
    load_tokenizer(model_path)
    return config


def validate_job(spec: JobSpec) -> list[InputFile]:
    """Everything `run` checks before loading weights; raises a BatchgenError naming the problem."""
    files = open_inputs(spec.input.path, input_columns(spec))
    check_sampling_columns(spec, files)
    carried_columns(spec, files[0].schema)
    check_model_folder(spec.model.path)
    from batchgen.engine.models import resolve_device  # why lazy: torch

    resolve_device(spec.model.device)  # a DeviceError (exit 4) names the devices on this machine
    return files
