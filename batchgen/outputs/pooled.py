"""The result columns of a pooling job (task embed, classify or score) and their values per row.

A pooling part keeps every base result column (so totals, resume, the manifest and the report
read it as any part): `generated_text` and `stop_reason` are null, `finish_reason` is "pooled"
(or "error"), `output_tokens` 0. Then the task's own columns:
- embed: `embedding`, fixed_size_list<float32> (float16 with pooling.embedding_dtype) of the
  model's hidden size (or pooling.dimensions); null on error rows;
- classify: `label` (config.id2label of the most probable class) and `probs` (list<float32>);
- score: `score` (float64).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from batchgen.errors import ModelError

POOLED_FINISH = "pooled"


def embedding_width(model_path: Path, dimensions: int | None) -> int:
    """The embedding column's width: pooling.dimensions, else the model's hidden size (config.json)."""
    if dimensions is not None:
        return dimensions
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path).get_text_config()
    except (OSError, ValueError) as exc:
        raise ModelError(f"model.path {model_path}: cannot read its config: {exc}") from exc
    return int(config.hidden_size)


def pooled_fields(spec: Any) -> list[pa.Field]:
    """The task's own columns, after the base result columns."""
    if spec.task == "embed":
        pooling = spec.pooling
        dtype = pa.float16() if pooling is not None and pooling.embedding_dtype == "float16" else pa.float32()
        width = embedding_width(spec.model.path, pooling.dimensions if pooling is not None else None)
        return [pa.field("embedding", pa.list_(dtype, width))]
    if spec.task == "classify":
        return [pa.field("label", pa.string()), pa.field("probs", pa.list_(pa.float32()))]
    if spec.task == "score":
        return [pa.field("score", pa.float64())]
    return []


def pooled_values(task: str, values: Any, label: str | None, float16: bool) -> dict[str, Any]:
    """One row's task columns from its result tensor (None: an error row)."""
    if task == "embed":
        if values is None:
            return {"embedding": None}
        array = values.numpy().astype(np.float16 if float16 else np.float32)
        return {"embedding": array}
    if task == "classify":
        return {"label": label, "probs": None if values is None else values.numpy().astype(np.float32)}
    return {"score": None if values is None else float(values)}


def pooled_array(values: list[Any], kind: pa.DataType) -> pa.Array:
    """A task column as Arrow: numpy rows (float16 included, which Python floats cannot fill) or nulls."""
    if not (pa.types.is_fixed_size_list(kind) or pa.types.is_list(kind)):
        return pa.array(values, kind)
    item = kind.value_type
    mask = np.array([v is None for v in values])
    lengths = [0 if v is None else len(v) for v in values]
    flat = np.concatenate([v for v in values if v is not None]) if any(lengths) else np.zeros(0)
    child = pa.array(flat.astype(item.to_pandas_dtype()), item)
    if pa.types.is_fixed_size_list(kind):
        width = kind.list_size
        filled = np.zeros((len(values), width), dtype=item.to_pandas_dtype())
        rows = [i for i, v in enumerate(values) if v is not None]
        if rows:
            filled[rows] = flat.reshape(len(rows), width)
        child = pa.array(filled.reshape(-1), item)
        return pa.FixedSizeListArray.from_arrays(child, width, mask=pa.array(mask))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, child, mask=pa.array(mask))
