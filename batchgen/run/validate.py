"""Checks that run before any work: the columns a job reads (present and of a usable type in every
file), the columns it carries (present with one type in every file), that the model folder has a
loadable config and tokenizer, with a chat template when the job has messages, and that the job's
values fit the model (context length, token ids, and what run/model_fit checks: pooling heads and
sizes, tensor-parallel splits; the LoRA adapters: job/adapters), all without loading weights."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.errors import InputDataError, JobFileError, ModelError
from batchgen.inputs.dataset import InputFile, check_column, with_rows
from batchgen.inputs.prepare import input_columns, load_tokenizer
from batchgen.inputs.reading import open_inputs
from batchgen.job.adapters import check_adapters
from batchgen.job.sections import SCHEMA_COLUMN_KEY
from batchgen.job.spec import JobSpec
from batchgen.outputs.table import carried_columns
from batchgen.run.model_fit import check_model_fit

log = logging.getLogger(__name__)
LISTED_FILES = 20  # `validate` names this many input files, then counts the rest


def check_carried_in_every_file(spec: JobSpec, files: list[InputFile], carried: list[str]) -> None:
    """Every carried column is in every file with one type, so no part can fail to write mid-run.

    Policy: no union schema. With carry_columns null (carry everything) every file must have the
    first file's columns, no more, no fewer; a named carry column must be in every file."""
    first = with_rows(files)[0]
    if spec.input.carry_columns is None:
        why = f" (input.carry_columns is null, so every column of {first.path} is carried; name the columns to carry)"
        for f in files:
            extra = [c for c in f.schema.names if c not in first.schema.names]
            if extra:
                raise InputDataError(f"{f.path}: column(s) {extra} are not in {first.path}{why}")
    else:
        why = " (named in input.carry_columns)"
    for column in carried:
        check_column(files, column, why)


def check_read_types(spec: JobSpec, files: list[InputFile]) -> None:
    """The prompt, messages and id columns have a type the job can use (one type in every file is
    checked when the files are opened, so the first file's type is every file's). A file with no
    rows has no values to check, and an empty JSONL file's columns no type (null)."""
    first = with_rows(files)[0]
    if first.num_rows == 0:
        return
    schema, where = first.schema, first.path
    i = spec.input
    if i.prompt_column is not None and not _is_text(schema.field(i.prompt_column).type):
        raise InputDataError(
            f"{where}: input.prompt_column {i.prompt_column!r} is "
            f"{schema.field(i.prompt_column).type}; it must be a string (or binary) column"
        )
    if i.messages_column is not None and not _is_messages(schema.field(i.messages_column).type):
        raise InputDataError(
            f"{where}: input.messages_column {i.messages_column!r} is "
            f"{schema.field(i.messages_column).type}; it must be a list of structs with "
            "string fields 'role' and 'content'"
        )
    if i.id_column is not None and pa.types.is_nested(schema.field(i.id_column).type):
        raise InputDataError(
            f"{where}: input.id_column {i.id_column!r} is {schema.field(i.id_column).type}; "
            "an id must be a scalar (string, integer, ...)"
        )


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return any(
        check(t)
        for check in (
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_string_view,
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_binary_view,
            pa.types.is_fixed_size_binary,
        )
    )


def check_sampling_columns(spec: JobSpec, files: list[InputFile]) -> None:
    """Before any work: each per-row sampling column holds numbers (or only nulls) in every file."""
    for f in with_rows(files):
        if f.num_rows == 0:
            continue
        for name, column in spec.input.sampling_columns.items():
            kind = f.schema.field(column).type
            if name == "stop":
                if not (_is_string(kind) or _is_text_list(kind) or pa.types.is_null(kind)):
                    raise InputDataError(
                        f"{f.path}: column {column!r} (input.sampling_columns.stop) holds {kind}; "
                        "stop needs a string or a list of strings"
                    )
                continue
            if name == SCHEMA_COLUMN_KEY:
                text = pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
                if not (text or pa.types.is_null(kind)):
                    raise InputDataError(
                        f"{f.path}: column {column!r} (input.sampling_columns.{name}) holds {kind}; "
                        "it needs JSON schema text (a string column)"
                    )
                continue
            if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_null(kind)):
                raise InputDataError(
                    f"{f.path}: column {column!r} (input.sampling_columns.{name}) holds {kind}; "
                    f"{name} needs numbers (an integer or float column)"
                )


def check_lora_column(spec: JobSpec, files: list[InputFile]) -> None:
    """Before any work: input.lora_column is in every file and holds adapter names (text)."""
    column = spec.input.lora_column
    if column is None:
        return
    check_column(files, column, " (input.lora_column)")
    for f in with_rows(files):
        kind = f.schema.field(column).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if f.num_rows and not (_is_string(kind) or pa.types.is_null(kind)):
            raise InputDataError(
                f"{f.path}: column {column!r} (input.lora_column) holds {kind}; "
                "it needs adapter names (a string column)"
            )


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _is_text_list(kind: pa.DataType) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and (
        _is_string(kind.value_type) or pa.types.is_null(kind.value_type)
    )


def _is_messages(t: pa.DataType) -> bool:
    if not (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
        or pa.types.is_fixed_size_list(t)
    ):
        return False
    item = t.value_type
    return pa.types.is_struct(item) and {"role", "content"} <= {item.field(k).name for k in range(item.num_fields)}


def check_model_folder(model_path: Path, needs_chat_template: bool = False) -> Any:
    """The model's config and tokenizer load (and the tokenizer has a chat template when
    `needs_chat_template`); weights are not touched. Returns the config."""
    from transformers import AutoConfig

    if not model_path.is_dir():
        raise ModelError(f"model.path {model_path}: no such folder")
    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path {model_path}: cannot load config.json: {exc}") from exc
    tokenizer = load_tokenizer(model_path)
    if needs_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            f"model.path {model_path}: the tokenizer has no chat template, so input.messages_column "
            "cannot be rendered; use input.prompt_column with text prompts, or a chat model"
        )
    return config


def check_model_limits(spec: JobSpec, config: Any) -> None:
    """The job's values that the model cannot take fail here (exit 2, naming the key), not at load
    (exit 4) or on every row: an engine.max_model_len beyond its positions, token ids in
    sampling.logit_bias or allowed_token_ids beyond its vocabulary."""
    from batchgen.engine.runner.model_limits import resolve_max_model_len  # why this module: no torch

    requested = spec.engine.max_model_len
    try:
        resolve_max_model_len(config, requested)
    except ValueError as exc:
        if requested is None:  # the model's own length cannot work: its config is the problem
            raise ModelError(f"model.path {spec.model.path}: {exc}; set engine.max_model_len") from None
        where = spec.where("engine.max_model_len")
        raise JobFileError(f"{where}: engine.max_model_len: {exc} (model.path {spec.model.path})") from None
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int):
        return
    s = spec.sampling
    for key, ids in (("logit_bias", s.logit_bias or {}), ("allowed_token_ids", s.allowed_token_ids or [])):
        bad = sorted({t for t in ids if t >= vocab})
        if bad:
            raise JobFileError(
                f"{spec.where('sampling.' + key)}: sampling.{key}: token ids {bad[:5]} are outside the model's "
                f"vocabulary [0, {vocab}) (model.path {spec.model.path})"
            )


def validate_job(spec: JobSpec) -> list[InputFile]:
    """Everything `run` checks before loading weights; raises a BatchgenError naming the problem.
    The output folder is never read as input, even when it lies inside input.path."""
    files = validate_inputs(spec)
    validate_model(spec)
    return files


def validate_inputs(spec: JobSpec) -> list[InputFile]:
    """The first half of validate_job: the input files and their columns, and that the model folder
    exists. Why apart: it imports neither torch nor transformers, so `run` answers a finished job
    or a held lock after it in well under a second (the fingerprint still covers the model files)."""
    from batchgen.run.image_checks import check_image_column

    files = open_inputs(
        spec.input.path,
        [c for c in input_columns(spec) if c != spec.input.image_column],  # (checked below, naming its key)
        exclude=spec.output.path,
        options=spec.input.storage_options,
        fmt=spec.input.format,
        named=spec.input.carry_columns,
    )
    check_read_types(spec, files)
    check_sampling_columns(spec, files)
    check_carried_in_every_file(spec, files, carried_columns(spec, with_rows(files)[0].schema))
    if spec.input.group_column is not None:
        check_column(files, spec.input.group_column, " (input.group_column)")
    check_image_column(spec, files)
    check_lora_column(spec, files)
    if not Path(spec.model.path).is_dir():
        raise ModelError(f"model.path {spec.model.path}: no such folder")
    return files


def validate_model(spec: JobSpec) -> None:
    """The second half of validate_job: config, tokenizer (and chat template), the model's limits
    against the job (engine.max_model_len, token ids) and the device."""
    config = check_model_folder(spec.model.path, needs_chat_template=spec.input.messages_column is not None)
    check_model_limits(spec, config)
    check_model_fit(spec, config)
    check_adapters(spec, config)  # every adapter folder read and checked against the model (job/adapters)
    if spec.input.image_column is not None:
        from batchgen.run.image_checks import check_vision_model

        check_vision_model(spec, config)
    if spec.model.device not in ("auto", "cpu"):  # why: those two always resolve; skip importing the engine
        from batchgen.engine.runner.models import DeviceError, resolve_device  # why lazy: torch, transformers

        try:
            resolve_device(spec.model.device)
        except DeviceError as exc:  # exit 4, naming the devices on this machine
            raise ModelError(str(exc)) from exc


def dtype_line(spec: JobSpec) -> str:
    """ "model.dtype auto -> bfloat16 (why)": what the job's dtype resolves to on this machine."""
    from batchgen.engine.api.dtype_rule import for_job  # why lazy: it asks torch for CUDA

    return "model." + for_job(spec.model.dtype, spec.model.device, str(spec.model.path)).line(spec.model.dtype)


def input_listing(files: list[InputFile], limit: int | None, most: int = LISTED_FILES) -> list[str]:
    """A line per input file the job reads, in reading order, with its rows (and how many of them
    input.limit leaves); at most `most` such lines, then one for the rest, and one for the files
    input.limit leaves unread."""
    lines, read, left = [], 0, limit  # left: rows input.limit still lets the job read; None: no limit
    for f in files:
        if left == 0:
            break
        note = f", reads the first {left} (input.limit)" if left is not None and left < f.num_rows else ""
        if read < most:
            lines.append(f"{f.path}: {f.num_rows} rows{note}")
        read += 1
        left = None if left is None else max(left - f.num_rows, 0)
    for group, why in ((files[most:read], ""), (files[read:], ", not read (input.limit)")):
        if group:
            lines.append(f"... and {len(group)} more file(s), {sum(f.num_rows for f in group)} rows{why}")
    return lines
