"""Rows sorted by their prefix key in bounded memory, and the parts cut along that order.

Why an external sort: a key is up to KEY_BLOCKS x 8 bytes a row, so ten million rows' keys do
not all fit in memory at once. Rows are sorted in runs of RUN_BYTES (Arrow's sort on the binary
key, then the input position, so equal keys keep input order), each run spilled to an Arrow IPC
file in a temp folder, and the runs merged as a stream: memory is one run while sorting and one
batch per run while merging.

A key is a list of 8-byte block hashes, compared bytewise: rows that share their first k blocks
are adjacent for every k (a trie's order), so nested prefixes sit next to each other. Parts are
cut along that order where the fewest blocks are shared across the cut (see cut_parts).
"""

from __future__ import annotations

import heapq
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HASH_BYTES = 8  # bytes of each block hash kept in a key
NO_REQUEST = b"\x00"  # a row that is no request (a bad row): not a whole hash, so left out of the floor
RUN_BYTES = 64 << 20  # key bytes (plus a per-row allowance) sorted in memory at a time
_ROW_OVERHEAD = 96  # Python's cost of one (bytes, int) beyond the key's own bytes
_MERGE_BATCH = 2048  # rows read from each run at a time while merging
_SCHEMA = pa.schema([("key", pa.binary()), ("row", pa.int64())])


class KeySorter:
    """Collects (key, input position) pairs; `merged` yields them sorted by (key, position)."""

    def __init__(self, folder: str, run_bytes: int = RUN_BYTES) -> None:
        self.folder, self.run_bytes = folder, run_bytes
        self.keys: list[bytes] = []
        self.rows = array("q")
        self.size = 0
        self.count = 0  # rows added
        self.runs: list[str] = []
        self._table: pa.Table | None = None  # the one sorted run, when nothing was spilled

    def add(self, keys: list[bytes], first_row: int) -> None:
        """Keys of the input rows first_row, first_row + 1, ..."""
        self.keys.extend(keys)
        self.rows.extend(range(first_row, first_row + len(keys)))
        self.count += len(keys)
        self.size += sum(len(k) for k in keys) + _ROW_OVERHEAD * len(keys)
        if self.size >= self.run_bytes:
            self._spill()

    def _sorted_run(self) -> pa.Table:
        table = pa.table({"key": pa.array(self.keys, pa.binary()), "row": pa.array(self.rows, pa.int64())})
        self.keys, self.rows, self.size = [], array("q"), 0
        return table.take(pc.sort_indices(table, sort_keys=[("key", "ascending"), ("row", "ascending")]))

    def _spill(self) -> None:
        path = os.path.join(self.folder, f"run-{len(self.runs):05d}.arrow")
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, _SCHEMA) as writer:
            writer.write_table(self._sorted_run(), max_chunksize=_MERGE_BATCH)
        self.runs.append(path)

    def merged(self) -> Iterator[tuple[bytes, int]]:
        """The rows in (key, position) order; may be called again (the plan takes two passes):
        no row may be added after the first call."""
        if not self.runs:  # everything fit in one run: no file at all, the sorted run kept
            if self._table is None:
                self._table = self._sorted_run()
            run = self._table
            for batch in run.to_batches(max_chunksize=_MERGE_BATCH):
                yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())
            return
        if self.keys:
            self._spill()
        yield from heapq.merge(*(_read_run(path) for path in self.runs))


def _read_run(path: str) -> Iterator[tuple[bytes, int]]:
    with pa.memory_map(path) as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())


def shared_blocks(a: bytes, b: bytes) -> int:
    """How many leading block hashes two keys share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n // HASH_BYTES
    differ = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return (n * 8 - differ.bit_length()) // (8 * HASH_BYTES)


@dataclass
class Cut:
    """Parts cut along the key order: part p holds rows[starts[p]:starts[p + 1]]."""

    rows: np.ndarray  # [input rows] int64 input positions, in key order
    starts: list[int] = field(default_factory=list)  # [parts + 1]
    joined: list[bool] = field(default_factory=list)  # [parts] the part continues the previous one's group


def cut_parts(ordered: Iterator[tuple[bytes, int]], window: int, floor: int | None = None) -> Cut:
    """Parts of at most `window` rows along `ordered`. Each cut falls, among the places that leave
    the part at least half a window, where the fewest leading blocks are shared across it (the
    last such place: parts stay full): a group of rows that share a prefix stays in one part, and a
    group larger than a part fills whole parts. A part is `joined` when the blocks shared across
    its first cut are more than the fewest any two neighbouring rows share (the prefix every row
    has, such as a chat template's header; `floor` when given, else the fewest along `ordered`):
    it goes on with the previous part's group."""
    rows = array("q")
    starts: list[int] = [0]
    cut_shared: list[int] = []
    keys: list[bytes] = []
    shared: list[int] = []  # shared[j]: blocks keys[j] shares with the row before it
    fewest: int | None = None
    last = b""
    for key, row in ordered:
        rows.append(row)
        shared.append(shared_blocks(last, key) if len(rows) > 1 else 0)
        if len(rows) > 1:
            fewest = shared[-1] if fewest is None else min(fewest, shared[-1])
        keys.append(key)
        last = key
        if len(keys) > window:
            least = max(1, window // 2)
            best = min(range(window, least - 1, -1), key=lambda c: shared[c])
            cut_shared.append(shared[0])
            starts.append(starts[-1] + best)
            keys, shared = keys[best:], shared[best:]
    if keys:
        cut_shared.append(shared[0])
        starts.append(len(rows))
    floor = fewest if floor is None else floor
    joined = [p > 0 and floor is not None and s > floor for p, s in enumerate(cut_shared)]
    return Cut(np.frombuffer(rows, dtype=np.int64).copy() if rows else np.zeros(0, np.int64), starts, joined)


def neighbour_shares(ordered: Iterator[tuple[bytes, int]], rows: int) -> tuple[np.ndarray, int | None]:
    """[rows] uint8, by input position: 1 + the most leading blocks the row shares with a
    neighbour in key order (in a trie's order, the most it shares with any other row); and the
    floor, the fewest any two neighbours share (None for fewer than two rows). A row that is no
    request (its key ends in NO_REQUEST, not a whole block hash) is left out of the floor: one bad
    row must not make every row that has the header a group. A short prompt with no full block
    still counts: it truly shares nothing with the others."""
    best = np.zeros(rows, np.uint8)
    floor: int | None = None
    last, before = b"", -1
    for key, row in ordered:
        if len(key) % HASH_BYTES:
            best[row] = 1
            continue
        shared = shared_blocks(last, key) if before >= 0 else 0
        best[row] = shared + 1
        if before >= 0:
            best[before] = max(best[before], shared + 1)
            floor = shared if floor is None else min(floor, shared)
        last, before = key, row
    return best, floor


def plan_parts(sorter: KeySorter, window: int) -> Cut:
    """The plan's parts. A row is grouped when it shares more than the floor's blocks (the prefix
    every row has) with another row; only those are moved: they come first, in key order, cut by
    cut_parts. Every other row (no prefix to share) keeps input order, cut into contiguous parts of
    `window` rows after them, so an input of unique prompts is read as it lies, not scattered.
    Rows are the input positions 0 .. sorter.count - 1. Two passes over the sorted keys."""
    best, floor = neighbour_shares(sorter.merged(), sorter.count)
    limit = (floor if floor is not None else 1 << 8) + 1
    together = best > limit  # [rows] bool: shares more than the floor with a neighbour
    cut = cut_parts(((k, r) for k, r in sorter.merged() if together[r]), window, floor)
    single = np.flatnonzero(~together)  # [singles] int64 input positions, in input order
    base = len(cut.rows)
    starts = cut.starts + [base + s for s in range(window, len(single), window)] + [base + len(single)]
    starts = starts if len(single) else cut.starts
    joined = cut.joined + [False] * (len(starts) - len(cut.starts))
    return Cut(np.concatenate([cut.rows, single.astype(np.int64)]), starts, joined)


def run_bounds(joined: list[bool], runs: int) -> list[int]:
    """[runs + 1] part offsets cutting parts into `runs` consecutive runs of about equal length,
    each boundary moved forward past parts that go on with a group (a group's parts stay in one
    run), never past the next boundary."""
    n = len(joined)
    bounds = [0]
    for r in range(1, runs):
        target = max(r * n // runs, bounds[-1])
        limit = (r + 1) * n // runs
        while target < limit and target < n and joined[target]:
            target += 1
        bounds.append(target)
    bounds.append(n)
    return bounds
