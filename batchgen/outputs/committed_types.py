"""A resumed output keeps the column types its committed parts have.

Why: the fingerprint covers the job and its inputs, not the types batchgen gives the columns it
builds itself. When an upgrade widens one (an OpenAI batch's carried `messages` gained the
`parts` field that image requests need), a resumed output would mix part schemas, and a reader
of the whole folder (pyarrow.dataset, Spark) would fail or drop the field. Where the committed
type is the new one without some struct fields, the new parts are written in the committed type:
nothing is lost that the older batchgen could have written (it refused what needs the new fields).
Any other difference is refused, naming the column and both types, before any work.
"""

from __future__ import annotations

import pyarrow as pa

from batchgen.errors import FingerprintMismatch
from batchgen.storage.base import Storage


def narrows(old: pa.DataType, new: pa.DataType) -> bool:
    """Whether `old` is `new` with zero or more struct fields left out (at any depth of lists and structs)."""
    if old == new:
        return True
    if pa.types.is_struct(old) and pa.types.is_struct(new):
        fields = {new.field(i).name: new.field(i).type for i in range(new.num_fields)}
        return all(
            old.field(i).name in fields and narrows(old.field(i).type, fields[old.field(i).name])
            for i in range(old.num_fields)
        )
    lists = (pa.types.is_list, pa.types.is_large_list)
    if any(kind(old) and kind(new) for kind in lists):
        return narrows(old.value_type, new.value_type)
    return False


def committed_schema(storage: Storage, committed: dict[int, str], schema: pa.Schema) -> pa.Schema:
    """The schema this run's parts are written with: `schema`, with each column whose committed
    parts hold a narrower type (see `narrows`) in that type; FingerprintMismatch (exit 2) for a
    column they hold in another type."""
    if not committed:
        return schema
    name = committed[min(committed)]
    old = storage.dataset([name]).schema
    fields = []
    for field in schema:
        kept = old.field(field.name).type if field.name in old.names else field.type
        if not narrows(kept, field.type):
            raise FingerprintMismatch(
                f"{storage.describe(name)}: the committed parts hold column {field.name!r} as {kept}, this "
                f"batchgen writes {field.type}; finish the job with the batchgen that started it, or "
                "rerun with --overwrite to start it again"
            )
        fields.append(field.with_type(kept))
    return pa.schema(fields, metadata=schema.metadata)
