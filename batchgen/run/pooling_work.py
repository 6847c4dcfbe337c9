"""One part's rows through a pooling model (task embed, classify or score): the prepared rows
(validated and tokenized by the RowPreparer, so an empty, undecodable or too-long prompt is
already an error row), score pairs built from the document column, the ok rows ordered for the
engine (shared prefixes together, then by length), and the result columns in input row order.

Why apart from part_work: generation's outputs are RequestOutputs with samples; a pooling row's
is one tensor. PartWork branches here at one place and commits the part the same way.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from batchgen.backends.pooling import PoolingBackend
from batchgen.engine.pooling.config import RowResult
from batchgen.engine.pooling.hf_runner import Encoded
from batchgen.inputs.ordering import order_requests
from batchgen.inputs.prepared_row import PreparedRow
from batchgen.job.spec import JobSpec
from batchgen.outputs.pooled import POOLED_FINISH, pooled_array, pooled_values
from batchgen.outputs.table import engine_error_message


def pooled_columns(
    spec: JobSpec, rows: list[PreparedRow], table: pa.Table, backend: PoolingBackend, fields: list[pa.Field]
) -> dict[str, Any]:
    """The part's result columns (`fields`: the job's, base ones first) for `rows`, in order."""
    inputs, pairs = _inputs(spec, rows, table, backend)
    ok = [i for i, row in enumerate(rows) if row.ok]
    order = [ok[j] for j in order_requests([inputs[i].input_ids for i in ok], spec.engine.ordering)]
    results: dict[int, RowResult] = {}
    if order:
        outs = backend.run(spec.task, [inputs[i] for i in order], [pairs[i] for i in order] if pairs else None)
        results = dict(zip(order, outs))
    billed = {i: len(e.input_ids) + (len(pairs[i][1].input_ids) if i in pairs else 0) for i, e in inputs.items()}
    return _columns(spec, rows, billed, results, backend, fields)


def _inputs(
    spec: JobSpec, rows: list[PreparedRow], table: pa.Table, backend: PoolingBackend
) -> tuple[dict[int, Encoded], dict[int, tuple[Encoded, Encoded]]]:
    """Each ok row's model input; score pairs: the (prompt, document) pair, tokenized together for
    a classifier (cross-encoder), apart for an embedding model (cosine)."""
    inputs = {i: Encoded(row.prompt_ids or []) for i, row in enumerate(rows) if row.ok}
    pooling = spec.pooling
    if pooling is None or pooling.document_column is None:
        return inputs, {}
    tokenizer, limit = backend.llm.tokenizer, backend.max_model_len
    docs = table.column(pooling.document_column).to_pylist()
    prompts = table.column(spec.input.prompt_column or "").to_pylist()
    pairs: dict[int, tuple[Encoded, Encoded]] = {}
    for i, row in enumerate(rows):
        doc = docs[i]
        if not row.ok:
            continue
        if not isinstance(doc, str) or not doc.strip():
            row.fail("empty_document", f"{row.label}: column {pooling.document_column!r} is null, empty or not text")
            continue
        if backend.model.classifier:
            enc = tokenizer(prompts[i], doc)
            types = enc.get("token_type_ids")
            inputs[i] = Encoded(list(enc["input_ids"]), list(types) if types is not None else None)
            longest = len(inputs[i].input_ids)
        else:
            second = Encoded(list(tokenizer(doc)["input_ids"]))
            pairs[i] = (inputs[i], second)
            longest = len(second.input_ids)
        if longest >= limit:
            row.fail("prompt_too_long", f"{row.label}: the pair has {longest} tokens; the model's context is {limit}")
    return {i: e for i, e in inputs.items() if rows[i].ok}, {i: p for i, p in pairs.items() if rows[i].ok}


def _columns(
    spec: JobSpec,
    rows: list[PreparedRow],
    billed: dict[int, int],
    results: dict[int, RowResult],
    backend: PoolingBackend,
    fields: list[pa.Field],
) -> dict[str, Any]:
    float16 = spec.pooling is not None and spec.pooling.embedding_dtype == "float16"
    cols: dict[str, list[Any]] = {f.name: [] for f in fields}
    for i, row in enumerate(rows):
        result = results.get(i)
        if result is not None and result.error is not None:
            row.fail("engine_error", engine_error_message(row.label, result.error))
        tensor = result.values if row.ok and result is not None else None
        ok = tensor is not None
        label = backend.model.label_of(tensor) if tensor is not None and spec.task == "classify" else None
        values = {
            "generated_text": None,
            "finish_reason": POOLED_FINISH if ok else "error",
            "stop_reason": None,
            "input_tokens": billed.get(i, 0) if ok else 0,
            "cached_tokens": result.cached_tokens if ok else 0,  # type: ignore[union-attr]
            "output_tokens": 0,
            "error_code": None if ok else row.error_code or "engine_error",
            "error_message": None if ok else row.error_message or "the model returned no output",
        }
        values.update(pooled_values(spec.task, tensor, label, float16))
        for name, value in values.items():
            cols[name].append(value)
    return {f.name: pooled_array(cols[f.name], f.type) if f.name not in _BASE else cols[f.name] for f in fields}


_BASE = {"generated_text", "finish_reason", "stop_reason", "input_tokens", "cached_tokens", "output_tokens",
         "error_code", "error_message"}  # fmt: skip
