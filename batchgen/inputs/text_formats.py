"""JSONL, CSV and OpenAI batch files as input tables: a scan when the job opens them (rows, column
types, seek points), then the rows of each part read as an Arrow table of the job's columns.

Column types are decided by the scan over the whole file, so every part of a file (and of every
file) has the same schema: JSONL keys take the Arrow type of their values (int and float mix to
float; values of types that cannot mix are kept as JSON text, marked in the field's metadata); CSV
columns are int64 when every value is an integer, float64 when every value is a number, else
string; an empty CSV field is null. A line that does not parse (or a CSV record whose field count
differs from the header's) is still a row: its values are null and the hidden PROBLEM_COLUMN says
what is wrong, so it becomes an error row and the job goes on. The hidden LINE_COLUMN gives every
row's line number, which the row's messages name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from batchgen.errors import InputDataError
from batchgen.inputs import openai_requests
from batchgen.inputs.text_lines import INDEX_STRIDE, Record, RecordIndex, csv_records, jsonl_records

PROBLEM_COLUMN = "_batchgen_row_problem"  # hidden: never carried, never in InputFile.schema
LINE_COLUMN = "_batchgen_line"  # hidden too: each row's first line, for messages (row_names.row_labels)
PROBLEM_TYPE = pa.struct([("code", pa.string()), ("message", pa.string())])
JSON_TEXT = b"batchgen.json_text"  # field metadata: values of mixed types, kept as JSON text
_INT = re.compile(r"[+-]?(0|[1-9][0-9]*)")
_FLOAT = re.compile(r"[+-]?((0|[1-9][0-9]*)(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_KINDS = {"int": pa.int64(), "float": pa.float64(), "string": pa.string()}


@dataclass(frozen=True)
class TextScan:
    num_rows: int
    schema: pa.Schema
    index: RecordIndex


class _Row(Exception):
    """One record's problem: `code` becomes the row's error_code, the message names the line."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _records(fmt: str, fh: Any, offset: int = 0, line: int = 1) -> Iterator[Record]:
    return csv_records(fh, offset, line) if fmt == "csv" else jsonl_records(fh, offset, line)


def scan(fmt: str, fh: Any, where: str) -> TextScan:
    """Count the rows of a jsonl / csv / openai_batch file, decide its columns, note seek points."""
    records = _records(fmt, fh)
    header: list[str] | None = None
    if fmt == "csv":
        header = _header(next(records, None), where)
    types = _CsvTypes(header) if header is not None else _JsonTypes()
    points: list[tuple[int, int, int]] = []
    rows = 0
    for record in records:
        if rows % INDEX_STRIDE == 0:
            points.append((rows, record.offset, record.line))
        if fmt != "openai_batch":
            types.add(record)
        rows += 1
    schema = openai_requests.SCHEMA if fmt == "openai_batch" else types.schema()
    if fmt == "csv" and rows == 0:  # a header-only file: no values to type its columns, and CSV is text
        schema = pa.schema([pa.field(name, pa.string()) for name in schema.names])
    return TextScan(rows, schema, RecordIndex(tuple(points)))


def _header(record: Record | None, where: str) -> list[str]:
    if record is None or record.csv_error or not record.text:
        problem = record.csv_error if record is not None and record.csv_error else "no header line"
        raise InputDataError(f"{where}: not a readable CSV file: {problem}")
    names = [str(name).strip() for name in record.text]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated or not all(names):
        raise InputDataError(
            f"{where}: the CSV header must name each column once (repeated: {repeated or 'an empty name'})"
        )
    return names


class _JsonTypes:
    """Each key's Arrow type over the whole file, from the values of every line that parses."""

    def __init__(self) -> None:
        self.types: dict[str, pa.DataType | None] = {}  # None: values of types that cannot mix
        self.pending: list[dict[str, Any]] = []

    def add(self, record: Record) -> None:
        try:
            value = json.loads(str(record.text))
        except json.JSONDecodeError:
            return
        if isinstance(value, dict):
            self.pending.append(value)
        if len(self.pending) >= 4096:
            self._flush()

    def _flush(self) -> None:
        keys = dict.fromkeys(k for row in self.pending for k in row)
        for key in keys:
            try:
                kind = pa.array([row.get(key) for row in self.pending]).type
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                kind = None
            known = self.types.get(key, pa.null())
            self.types[key] = None if kind is None or known is None else _merge(known, kind)
        self.pending = []

    def schema(self) -> pa.Schema:
        self._flush()
        fields = []
        for key, kind in self.types.items():
            if key == PROBLEM_COLUMN:
                continue
            fields.append(
                pa.field(key, pa.string(), metadata={JSON_TEXT: b"1"}) if kind is None else pa.field(key, kind)
            )
        return pa.schema(fields)


def _merge(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    if a == b or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    if {pa.types.is_integer(a) or pa.types.is_floating(a), pa.types.is_integer(b) or pa.types.is_floating(b)} == {True}:
        return pa.float64()
    try:
        both = [pa.schema([("v", a)]), pa.schema([("v", b)])]
        return pa.unify_schemas(both, promote_options="permissive").field("v").type
    except (pa.ArrowException, TypeError):
        return None


class _CsvTypes:
    """Each column's narrowest kind (int, then float, then string) over every well-formed record."""

    def __init__(self, header: list[str]) -> None:
        self.header = header
        self.kinds = ["int"] * len(header)

    def add(self, record: Record) -> None:
        if record.csv_error or len(record.text) != len(self.header):
            return
        for i, value in enumerate(record.text):
            kind = self.kinds[i]
            if value == "" or kind == "string":
                continue
            if kind == "int" and not _INT.fullmatch(value):
                kind = "float"
            if kind == "float" and not _FLOAT.fullmatch(value):
                kind = "string"
            self.kinds[i] = kind

    def schema(self) -> pa.Schema:
        return pa.schema([pa.field(n, _KINDS[k]) for n, k in zip(self.header, self.kinds)])


def read_rows(
    fmt: str, fh: Any, index: RecordIndex, schema: pa.Schema, start: int, stop: int
) -> Iterator[tuple[int, dict[str, Any] | _Row]]:
    """(first line, values by column or the row's problem) of rows [start, stop)."""
    first, offset, line = index.start_for(start)
    row = first
    for record in _records(fmt, fh, offset, line):
        if row >= stop:
            return
        if row >= start:
            try:
                yield record.line, _values(fmt, record, schema)
            except _Row as problem:
                yield record.line, problem
        row += 1


def _values(fmt: str, record: Record, schema: pa.Schema) -> dict[str, Any]:
    if record.bad_utf8:
        raise _Row("invalid_utf8", "not valid UTF-8")
    if fmt == "openai_batch":
        try:
            return openai_requests.request_row(str(record.text))
        except openai_requests.RequestProblem as exc:
            raise _RequestRow(exc.code, str(exc), exc.custom_id) from None
    if fmt == "csv":
        return _csv_values(record, schema)
    try:
        value = json.loads(str(record.text))
    except json.JSONDecodeError as exc:
        raise _Row("invalid_json", f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _Row("invalid_json", f"a row must be a JSON object, got {type(value).__name__}")
    for field in schema:
        if field.metadata and JSON_TEXT in field.metadata and field.name in value:
            v = value[field.name]
            value[field.name] = v if v is None or isinstance(v, str) else json.dumps(v, ensure_ascii=False)
    return value


class _RequestRow(_Row):
    """A refused OpenAI request: its custom_id (when the line had one) still names its output line."""

    def __init__(self, code: str, message: str, custom_id: str | None) -> None:
        super().__init__(code, message)
        self.custom_id = custom_id


def _csv_values(record: Record, schema: pa.Schema) -> dict[str, Any]:
    if record.csv_error:
        raise _Row("invalid_csv", f"malformed CSV record: {record.csv_error}")
    if len(record.text) != len(schema):
        raise _Row("invalid_csv", f"{len(record.text)} fields, the header has {len(schema)}")
    values: dict[str, Any] = {}
    for field, text in zip(schema, record.text):
        if text == "":
            values[field.name] = None
        elif pa.types.is_integer(field.type):
            values[field.name] = int(text)
        elif pa.types.is_floating(field.type):
            values[field.name] = float(text)
        else:
            values[field.name] = text
    return values


def rows_table(rows: list[dict[str, Any] | _Row], lines: list[int], schema: pa.Schema, columns: list[str]) -> pa.Table:
    """The table of `rows` with `columns` (in the file's types), the PROBLEM_COLUMN and the LINE_COLUMN."""
    wanted = pa.schema([schema.field(c) for c in columns])
    values: list[dict[str, Any]] = []
    problems: list[dict[str, str] | None] = []
    for row in rows:
        if isinstance(row, _Row):
            custom_id = getattr(row, "custom_id", None)
            values.append({"custom_id": custom_id} if custom_id is not None else {})
            problems.append({"code": row.code, "message": str(row)})
        else:
            values.append(row)
            problems.append(None)
    try:
        table = pa.Table.from_pylist(values, schema=wanted)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        table = _row_by_row(values, problems, wanted)
    table = table.append_column(pa.field(PROBLEM_COLUMN, PROBLEM_TYPE), pa.array(problems, PROBLEM_TYPE))
    return table.append_column(pa.field(LINE_COLUMN, pa.int64()), pa.array(lines, pa.int64()))


def _row_by_row(values: list[dict[str, Any]], problems: list[dict[str, str] | None], wanted: pa.Schema) -> pa.Table:
    """A value that does not fit its column's type fails its row only (a file changed since the scan)."""
    tables = []
    for i, row in enumerate(values):
        try:
            tables.append(pa.Table.from_pylist([row], schema=wanted))
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
            tables.append(pa.Table.from_pylist([{}], schema=wanted))
            problems[i] = {"code": "invalid_value", "message": f"a value does not fit its column's type: {exc}"}
    return pa.concat_tables(tables) if tables else wanted.empty_table()


def line_problems(table: pa.Table) -> Iterator[tuple[int, str, str]]:
    """(row, error code, message) of each row of `table` whose input line did not parse."""
    if PROBLEM_COLUMN not in table.column_names:
        return
    for i, problem in enumerate(table.column(PROBLEM_COLUMN).to_pylist()):
        if problem is not None:
            yield i, problem["code"], problem["message"]
