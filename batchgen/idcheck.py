"""Duplicate ids across the whole job: the first occurrence is served, later ones become error rows.

Two streaming passes over the id column only. Pass one keeps a 64-bit hash per row (8 bytes a
row: a million rows cost 8 MB) and finds the hashes seen twice; pass two confirms candidates by
exact value, so a hash collision can never fail a row.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from batchgen.dataset import InputFile, Shard, read_shards


def find_duplicate_ids(files: list[InputFile], shards: list[Shard], id_column: str) -> dict[tuple[int, int], str]:
    """{(file index, row index): message} for every row whose id already appeared earlier."""
    hashes = [_hash(table.column(id_column).to_pandas()) for _, table in read_shards(files, shards, [id_column])]
    if not hashes:
        return {}
    ordered = np.sort(np.concatenate(hashes))
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not repeated:
        return {}
    first: dict[object, str] = {}
    later: dict[tuple[int, int], str] = {}
    for shard, table in read_shards(files, shards, [id_column]):
        values = table.column(id_column).to_pandas()
        for offset in np.flatnonzero(np.isin(_hash(values), list(repeated))):
            value, row = values.iloc[offset], shard.start + int(offset)
            if value in first:
                later[(shard.file_index, row)] = f"duplicate id {value!r}: first used by {first[value]}"
            else:
                first[value] = f"{files[shard.file_index].path} row {row}"
    return later


def _hash(values: pd.Series) -> np.ndarray:
    return pd.util.hash_pandas_object(values, index=False).to_numpy()  # [rows] uint64, deterministic
