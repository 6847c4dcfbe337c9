"""Cutting a stream of record batches into the wanted shards (contiguous row ranges), in order.

Why one place: every streamed input (Parquet row groups, a `datasets` Arrow stream) arrives as
batches in file order while a worker wants only some parts of the file; rows before a wanted
shard (committed parts a resumed run skips) are dropped as they arrive, so memory stays one part
plus one batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, TypeVar

import pyarrow as pa


class RowRange(Protocol):
    """What is cut: a contiguous range of file rows (inputs.dataset.Shard)."""

    @property
    def start(self) -> int: ...
    @property
    def stop(self) -> int: ...
    @property
    def num_rows(self) -> int: ...


Shard = TypeVar("Shard", bound=RowRange)


def cut_shards(
    batches: Iterable[pa.RecordBatch], pending: list[Shard], offset: int = 0
) -> Iterator[tuple[Shard, pa.Table]]:
    """(shard, its rows) for each of `pending` (sorted by start; popped as they are served), from
    `batches` whose first row is file row `offset`. Shards still in `pending` after the last
    batch were past the end of the stream: the caller says so."""
    buffered: list[pa.RecordBatch] = []
    end = offset  # file row just past the buffered rows; offset: file row of buffered[0]'s first row
    for batch in batches:
        buffered.append(batch)
        end += batch.num_rows
        while pending and end >= pending[0].stop:
            shard = pending.pop(0)
            table = pa.Table.from_batches(buffered, schema=batch.schema)
            yield shard, table.slice(shard.start - offset, shard.num_rows)
            buffered, offset = table.slice(shard.stop - offset).to_batches(), shard.stop
        if not pending:
            return
        keep_from = min(pending[0].start, end)
        if keep_from > offset:
            table = pa.Table.from_batches(buffered, schema=batch.schema)
            buffered, offset = table.slice(keep_from - offset).to_batches(), keep_from
