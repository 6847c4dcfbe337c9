"""A part's rows wherever they lie in the input: a contiguous Shard of one file (the layout of
`input.grouping: none` and of outputs made before prefix grouping) or a GroupedPart (rows of the
whole input that share prefixes, cut from the job's plan: batchgen.inputs.grouping), read as one
table with each row's place (file, row in the file, position in the input).

Why one reader for both: everything after reading (row names, ids, seeds, duplicate ids, the
output's `input_row` and `row_id`) goes by each row's place, so a part is prepared, generated and
committed the same way whatever its layout.

A grouped part's rows are scattered over the input. They are read in waves: the rows of as many
consecutive parts as fit WAVE_ROWS, each file streamed once per wave over the ranges that hold
them (read_shards: Parquet row groups before the first wanted row are skipped, text files seek),
so memory stays one wave; an input whose groups already lie together is read about once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from batchgen.inputs.dataset import InputFile, Shard
from batchgen.inputs.reading import read_shards

WAVE_ROWS = 65536  # rows of grouped parts read per pass over the input
# An image job's rows hold their images' encoded bytes: a wave is then about one part (window_rows).
IMAGE_WAVE_ROWS = 1024
_GAP_ROWS = 4096  # wanted rows closer than this are read as one range (one seek, one decode)


@dataclass(frozen=True, eq=False)
class GroupedPart:
    """A part cut from the prefix plan: input positions of its rows, in plan (key) order."""

    index: int
    rows: np.ndarray  # [rows] int64 positions over all input files in file order (the output's input_row)
    joined: bool = False  # it continues the previous part's group (a group larger than a part)

    @property
    def num_rows(self) -> int:
        return len(self.rows)


Part = Shard | GroupedPart


def describe(part: Part, files: list[InputFile]) -> str:
    """Which rows a part holds, for messages."""
    if isinstance(part, GroupedPart):
        return f"part {part.index} ({part.num_rows} rows grouped by shared prefix)"
    return f"rows {part.start}-{part.stop - 1} of {files[part.file_index].path}"


@dataclass(frozen=True)
class PartRows:
    """One part read: its table (the job's columns) and where each of its rows lies."""

    part: Part
    table: pa.Table
    file_index: list[int]  # [rows] the input file each row comes from
    file_row: list[int]  # [rows] its row in that file
    input_row: list[int]  # [rows] its position over all files (file order), as the output's input_row


def file_offsets(files: list[InputFile]) -> np.ndarray:
    """[files + 1] the input position of each file's first row, then the total."""
    return np.concatenate([[0], np.cumsum([f.num_rows for f in files], dtype=np.int64)]).astype(np.int64)


def read_parts(
    files: list[InputFile], parts: list[Part], columns: list[str], wave_rows: int = WAVE_ROWS
) -> Iterator[PartRows]:
    """Each part's rows, in the order of `parts` for grouped ones (contiguous ones file by file);
    `wave_rows`: rows of grouped parts read at a time (IMAGE_WAVE_ROWS for an image job)."""
    offsets = file_offsets(files)
    shards = [p for p in parts if isinstance(p, Shard)]
    for shard, table in read_shards(files, shards, columns):
        first = int(offsets[shard.file_index])
        rows = list(range(shard.start, shard.stop))
        yield PartRows(shard, table, [shard.file_index] * len(rows), rows, [first + r for r in rows])
    grouped = [p for p in parts if isinstance(p, GroupedPart)]
    for wave in _waves(grouped, wave_rows):
        yield from _read_wave(files, offsets, wave, columns)


def _waves(parts: list[GroupedPart], wave_rows: int) -> Iterator[list[GroupedPart]]:
    wave: list[GroupedPart] = []
    rows = 0
    for part in parts:
        if wave and rows + part.num_rows > wave_rows:
            yield wave
            wave, rows = [], 0
        wave.append(part)
        rows += part.num_rows
    if wave:
        yield wave


def _read_wave(
    files: list[InputFile], offsets: np.ndarray, wave: list[GroupedPart], columns: list[str]
) -> Iterator[PartRows]:
    wanted = np.unique(np.concatenate([np.asarray(p.rows, dtype=np.int64) for p in wave]))  # [rows] sorted
    file_of = np.searchsorted(offsets, wanted, side="right") - 1  # [rows]
    pieces: list[pa.Table] = []
    found: list[np.ndarray] = []  # input positions of the rows of each piece, in piece order
    ranges = _ranges(wanted - offsets[file_of], file_of)
    for shard, table in read_shards(files, ranges, columns):
        first = int(offsets[shard.file_index])
        mine = wanted[(wanted >= first + shard.start) & (wanted < first + shard.stop)]
        pieces.append(table.take(pa.array(mine - first - shard.start)))
        found.append(mine)
    table = pa.concat_tables(pieces, promote_options="permissive") if len(pieces) > 1 else pieces[0]
    where = np.concatenate(found)  # [rows] input position of each row of `table`
    order = np.argsort(where)  # where[order] == wanted
    for part in wave:
        at = np.searchsorted(wanted, part.rows)  # [part rows] index into wanted
        file_index = file_of[at]
        file_row = part.rows - offsets[file_index]
        take = pa.array(order[at], pa.int64())
        rows = part.rows.tolist()
        yield PartRows(part, table.take(take), file_index.tolist(), file_row.tolist(), rows)


def _ranges(file_rows: np.ndarray, file_of: np.ndarray) -> list[Shard]:
    """Contiguous ranges covering the wanted rows of each file (rows closer than _GAP_ROWS joined)."""
    ranges: list[Shard] = []
    for f in np.unique(file_of):
        rows = file_rows[file_of == f]  # sorted
        breaks = np.flatnonzero(np.diff(rows) > _GAP_ROWS)
        starts = np.concatenate([[0], breaks + 1])
        stops = np.concatenate([breaks, [len(rows) - 1]])
        for a, b in zip(starts, stops):
            ranges.append(Shard(len(ranges), int(f), int(rows[a]), int(rows[b]) + 1))
    return ranges
