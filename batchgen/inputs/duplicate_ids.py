"""Ids across the whole job: the first occurrence of an id is served, later ones become
`duplicate_id` error rows; a null (or NaN) id is a `missing_id` error row, since its output could
not be joined back to its input.

Two streaming passes over the id column only. Pass one keeps a 64-bit hash per row (8 bytes a
row: a million rows cost 8 MB) and finds the hashes seen twice; pass two confirms candidates by
exact value, so a hash collision can never fail a row.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from batchgen.inputs.dataset import InputFile, Shard
from batchgen.inputs.reading import read_shards


class IdProblem(NamedTuple):
    """Why a row cannot be served under its id: the row's error code and message."""

    code: str  # duplicate_id | missing_id
    message: str


def find_duplicate_ids(files: list[InputFile], shards: list[Shard], id_column: str) -> dict[tuple[int, int], IdProblem]:
    """{(file index, row index): problem} for every row whose id is null or already appeared earlier."""
    problems: dict[tuple[int, int], IdProblem] = {}
    hashes = []
    for shard, table in read_shards(files, shards, [id_column]):
        present, row_hashes = _present_hashes(table.column(id_column))
        for offset in np.flatnonzero(~present):
            problems[(shard.file_index, shard.start + int(offset))] = IdProblem("missing_id", "id is null")
        hashes.append(row_hashes)
    if not hashes:
        return problems
    ordered = np.sort(np.concatenate(hashes))
    repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
    if len(repeated):
        problems.update(_confirm(files, shards, id_column, repeated))
    return problems


def _confirm(
    files: list[InputFile], shards: list[Shard], id_column: str, repeated: np.ndarray
) -> dict[tuple[int, int], IdProblem]:
    """Pass two: of the rows whose hash repeats, the later uses of an exact same id."""
    first: dict[object, str] = {}
    later: dict[tuple[int, int], IdProblem] = {}
    for shard, table in read_shards(files, shards, [id_column]):
        column = table.column(id_column)
        present, row_hashes = _present_hashes(column)
        for offset in np.flatnonzero(present)[np.isin(row_hashes, repeated)]:
            value, row = column[int(offset)].as_py(), shard.start + int(offset)
            if value in first:
                later[(shard.file_index, row)] = IdProblem(
                    "duplicate_id", f"duplicate id {value!r}: first used by {first[value]}"
                )
            else:
                first[value] = f"{files[shard.file_index].path} row {row}"
    return later


def _present_hashes(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """([rows] bool: the id is set, [ids set] uint64 hashes of those ids).

    A NaN id counts as missing: it equals nothing, not even itself. Nulls are dropped before
    hashing so that an integer id hashes the same in a window with nulls as in one without.
    """
    if pa.types.is_string_view(column.type) or pa.types.is_binary_view(column.type):
        # why: Arrow has no filter kernel for the view types; the large ones hash the same values alike
        column = column.cast(pa.large_string() if pa.types.is_string_view(column.type) else pa.large_binary())
    present = pc.invert(pc.is_null(column, nan_is_null=True)).to_numpy(zero_copy_only=False)
    values = column.filter(pa.array(present)).to_pandas()
    return present, pd.util.hash_pandas_object(values, index=False).to_numpy()  # deterministic
