"""Checks of an image job (`input.image_column`) that run before any work: the column is in every
input file with a type that can hold images, and the model reads images (a vision-language model
whose family the engine serves). Apart from validate.py because only image jobs need them."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.errors import InputDataError, JobFileError
from batchgen.inputs.dataset import InputFile, check_column, with_rows
from batchgen.job.spec import JobSpec

IMAGE_VALUES = "image bytes, a path or URI string, a {bytes, path} struct, or a list of these"


def check_image_column(spec: JobSpec, files: list[InputFile]) -> None:
    """input.image_column is in every file, and holds IMAGE_VALUES (or only nulls)."""
    column = spec.input.image_column
    if column is None:
        return
    check_column(files, column, " (input.image_column)")
    first = with_rows(files)[0]
    kind = first.schema.field(column).type
    if first.num_rows and not _holds_images(kind):
        raise InputDataError(
            f"{first.path}: column {column!r} (input.image_column) is {kind}; it must hold {IMAGE_VALUES}"
        )


def _holds_images(kind: pa.DataType) -> bool:
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        kind = kind.value_type
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    if pa.types.is_struct(kind):
        names = {kind.field(i).name for i in range(kind.num_fields)}
        return bool(names & {"bytes", "path"}) and names <= {"bytes", "path"}
    return pa.types.is_null(kind) or _is_scalar_image(kind)


def _is_scalar_image(kind: pa.DataType) -> bool:
    return any(
        check(kind)
        for check in (
            pa.types.is_binary,
            pa.types.is_large_binary,
            pa.types.is_binary_view,
            pa.types.is_fixed_size_binary,
            pa.types.is_string,
            pa.types.is_large_string,
            pa.types.is_string_view,
        )
    )


def check_vision_model(spec: JobSpec, config: Any) -> None:
    """An image job's model reads images: a vision-language family the engine serves (exit 2 naming
    input.image_column: the job asks what the model cannot do)."""
    if spec.input.image_column is None:
        return
    from batchgen.engine.vision.processor import FAMILIES, vision_family

    model_type = str(getattr(config, "model_type", ""))
    if vision_family(model_type) is None:
        kind = "a text-only model" if getattr(config, "vision_config", None) is None else "not a served vision model"
        raise JobFileError(
            f"{spec.where('input.image_column')}: input.image_column needs a vision-language model; "
            f"model.path {spec.model.path} is {kind} (model_type {model_type!r}; served: {', '.join(sorted(FAMILIES))})"
        )
