"""Records of line-based text inputs (JSONL, CSV, OpenAI batch files), each with where it starts.

Why our own reader and not pyarrow's: pyarrow's JSON and CSV readers fail on the first bad line,
and a bad line must cost its own row only. Here a file is read as bytes, line by line, in chunks
(bounded memory whatever its size), and each record remembers its byte offset and line number, so
a part can start reading at a record boundary (`RecordIndex`) instead of at the file's start.
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

CHUNK_BYTES = 1 << 20
INDEX_STRIDE = 4096  # a seek point every this many records: a late part skips at most this many


@dataclass(frozen=True)
class Record:
    """One record: its first line number (1-based), its byte offset, and its text fields.

    `text` is the raw line (JSONL) or the parsed fields (CSV); `bad_utf8` says a line of it was
    not valid UTF-8 (decoded with replacement characters so the rest of the file still reads)."""

    line: int
    offset: int
    text: str | list[str]
    bad_utf8: bool = False
    csv_error: str | None = None


UTF8_BOM = b"\xef\xbb\xbf"


def read_lines(fh: Any, offset: int = 0, line: int = 1) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, bytes without the newline) of each line from `offset` on.

    A UTF-8 byte-order mark at the file's start (Excel's "CSV UTF-8" writes one) is skipped, so
    it never becomes part of the first header name or the first JSON line."""
    fh.seek(offset)
    if offset == 0:
        if fh.read(len(UTF8_BOM)) == UTF8_BOM:
            offset = len(UTF8_BOM)
        else:
            fh.seek(0)
    held: list[bytes] = []  # the chunks of a line not yet ended (why a list: joined once, not per chunk)
    pos = offset
    while True:
        chunk = fh.read(CHUNK_BYTES)
        if not chunk:
            break
        held.append(chunk)
        if b"\n" not in chunk:
            continue
        *lines, rest = b"".join(held).split(b"\n")
        held = [rest] if rest else []
        for raw in lines:
            yield line, pos, raw
            pos += len(raw) + 1
            line += 1
    if held:
        yield line, pos, b"".join(held)


def _decode(raw: bytes) -> tuple[str, bool]:
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        return raw.decode("utf-8", errors="replace"), True


def jsonl_records(fh: Any, offset: int = 0, line: int = 1) -> Iterator[Record]:
    """One record per non-blank line (a blank line, the trailing one included, is no row)."""
    for number, pos, raw in read_lines(fh, offset, line):
        if raw.strip():
            text, bad = _decode(raw.rstrip(b"\r"))
            yield Record(number, pos, text, bad)


class _Feed:
    """Decoded lines for csv.reader, remembering where each line started; csv.reader asks for a
    line only when its record needs one, so the lines taken since the last record are this record's."""

    def __init__(self, lines: Iterator[tuple[int, int, bytes]]) -> None:
        self.lines = lines
        self.taken: list[tuple[int, int, bool]] = []  # (line, offset, bad utf-8) since the last record

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> str:
        number, pos, raw = next(self.lines)
        text, bad = _decode(raw)
        self.taken.append((number, pos, bad))
        return text + "\n"


def csv_records(fh: Any, offset: int = 0, line: int = 1) -> Iterator[Record]:
    """One record per CSV record (a quoted field may span lines); blank lines are no records.
    A record csv cannot parse becomes a Record with `csv_error`, and reading goes on after it."""
    feed = _Feed(read_lines(fh, offset, line))
    # why: csv's default field limit (128 KiB) would fail a long document; a field is bounded by the file
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
    reader = csv.reader(feed, strict=True)
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            first = feed.taken[0] if feed.taken else (0, 0, False)
            feed.taken = []
            yield Record(first[0], first[1], [], first[2], csv_error=str(exc))
            continue
        taken, feed.taken = feed.taken, []
        if fields and taken:
            yield Record(taken[0][0], taken[0][1], fields, any(bad for _, _, bad in taken))


@dataclass(frozen=True)
class RecordIndex:
    """Seek points: (record number, byte offset, line number) of every INDEX_STRIDE-th record."""

    points: tuple[tuple[int, int, int], ...] = ()

    def start_for(self, record: int) -> tuple[int, int, int]:
        """The last seek point at or before `record`; (0, 0, 1) when there is none."""
        best = (0, 0, 1)
        for point in self.points:
            if point[0] > record:
                break
            best = point
        return best
