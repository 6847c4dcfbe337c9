"""Duplicate ids across the whole job: the first occurrence is served, later ones become error rows.

Two streaming passes over the id column only: value counts find the duplicated values (memory:
the id column, not the rows), then a second pass finds each one's first occurrence.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from batchgen.dataset import InputFile, Shard, read_shards


def find_duplicate_ids(files: list[InputFile], shards: list[Shard], id_column: str) -> dict[tuple[int, int], str]:
    """{(file index, row index): message} for every row whose id already appeared earlier."""
    chunks = [table.column(id_column) for _, table in read_shards(files, shards, [id_column])]
    if not chunks:
        return {}
    ids = pa.chunked_array([c for chunk in chunks for c in chunk.chunks], type=chunks[0].type)
    counts = pc.value_counts(ids)
    repeated = set(counts.field("values").filter(pc.greater(counts.field("counts"), 1)).to_pylist())
    repeated.discard(None)
    if not repeated:
        return {}
    first: dict[object, str] = {}
    later: dict[tuple[int, int], str] = {}
    for shard, table in read_shards(files, shards, [id_column]):
        for offset, value in enumerate(table.column(id_column).to_pylist()):
            if value not in repeated:
                continue
            where = f"{files[shard.file_index].path} row {shard.start + offset}"
            if value in first:
                later[(shard.file_index, shard.start + offset)] = f"duplicate id {value!r}: first used by {first[value]}"
            else:
                first[value] = where
    return later
