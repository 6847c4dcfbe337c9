"""The job's prefix plan: which input rows form each part, so that rows sharing a prompt prefix
(many questions over one document, one long instruction per task type, a RAG context reused)
land in one part and its prefix is prefilled once per job, not once per part.

One streamed pass over the prompt's columns only (`READ_ROWS` rows at a time) keys every row by
its prompt exactly as the engine will see it (chat template applied, special tokens added): the
chained hashes of its leading full KV blocks, made by the block manager's own chain
(`chain_block_hashes`), so a key means what the prefix cache means. An image row's key is made the
same way with its images' content hashes at their expanded positions (RequestExtras: the block
hash's one rule), so rows with one image and the same leading text group, and two images never
do; it costs reading each image's bytes and header once more (no pixel is decoded), about 0.5 ms
a row on one core, next to the tower and prefill every image row costs in the engine. With `input.group_column`
the hash of that column's value comes first, so the user's groups are never mixed. Rows are
sorted by key over the whole input in bounded memory (key_sort) and parts cut along that order.

Only rows that share a prefix move. A row that shares nothing with another row beyond the
prefix every row has (a chat template's header; with a group column, a value no other row has)
keys by what is effectively a random hash: sorting would scatter it over the input for nothing.
Such rows keep input order, in contiguous parts after the grouped ones (key_sort.plan_parts).

The plan is a pure function of the input, the job and the tokenizer: every process that computes
it gets the same one. It is still stored once in the output (outputs/plan_file) and read back by
every other run, shard and worker, so they never depend on computing it alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import tempfile
from typing import Any

from batchgen.engine.core.block_hash import chain_block_hashes
from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras
from batchgen.inputs.adapter_column import adapter_column, row_adapters
from batchgen.inputs.dataset import InputFile, plan_shards
from batchgen.inputs.key_sort import HASH_BYTES, NO_REQUEST, Cut, KeySorter, plan_parts
from batchgen.inputs.part_rows import file_offsets
from batchgen.inputs.prepare import RowPreparer, image_folder, input_columns
from batchgen.inputs.prepared_row import PreparedRow
from batchgen.inputs.reading import read_shards
from batchgen.job.spec import JobSpec

log = logging.getLogger(__name__)
KEY_BLOCKS = 64  # leading KV blocks a key holds (at block size 16: the first 1024 tokens)
READ_ROWS = 8192  # rows tokenized at a time in the key pass
IMAGE_READ_ROWS = 256  # with input.image_column: a read holds the rows' image bytes
# Why a character budget: only the first KEY_BLOCKS blocks make a key, so a long prompt (a RAG
# context of thousands of tokens) is tokenized only so far. Budget / tokens: 8 characters a token
# at least, plenty for natural text; a text denser than that only gets a shorter key.
CHARS_PER_KEY_TOKEN = 8
CUT_MARGIN = 32  # tokens dropped before a cut: a token there may have continued past it


def grouped(spec: JobSpec, with_cache: bool = False) -> bool:
    """Whether a new output of the job has its parts from a prefix plan: `input.grouping: auto`
    where a prefix cache would use it (generation on the native engine with prefix caching; the
    hf backend and the pooling tasks keep none, so their parts stay in input order).
    `with_cache`: as if the job had the native engine's prefix cache (what `estimate` says it
    would serve)."""
    engine = spec.engine
    caches = with_cache or (engine.backend == "native" and engine.enable_prefix_caching)
    return spec.input.grouping == "auto" and spec.task == "generate" and caches


def key_columns(spec: JobSpec) -> list[str]:
    """The columns the key pass reads: what the prompt is made of, and the group column."""
    i = spec.input
    if i.format == "openai_batch":  # a request's prompt and whether it can be served: its request columns
        names = input_columns(spec)
    else:
        names = [c for c in (i.prompt_column or i.messages_column, i.image_column) if c is not None]
    if i.group_column is not None:
        names.append(i.group_column)
    column = adapter_column(spec)
    if column is not None:
        names.append(column)
    return list(dict.fromkeys(names))


def prompt_key(
    prompt_ids: list[int] | None, block_size: int, cut: bool = False, extras: RequestExtras = NO_EXTRAS
) -> bytes:
    """The first HASH_BYTES of the chained hash of each of the prompt's leading full blocks (at
    most KEY_BLOCKS; the last token is always computed, so a block ending on it is left out, as
    the block manager leaves it); NO_REQUEST for a row that is no request. `cut`: the ids are of the
    prompt's first MAX_CHARS characters, so the last CUT_MARGIN tokens (which the rest of the text
    could have tokenized otherwise) are left out too. `extras`: what else the request's blocks
    hash (its adapter's content hash; its images' content hashes at their positions), as the block
    manager hashes them."""
    if prompt_ids is None:
        return NO_REQUEST
    if not prompt_ids:
        return b""
    usable = len(prompt_ids) - (CUT_MARGIN if cut else 1)
    blocks = max(0, min(usable // block_size, KEY_BLOCKS))
    return b"".join(h[:HASH_BYTES] for h in chain_block_hashes(prompt_ids, block_size, blocks, [], extras))


def group_key(value: Any) -> bytes:
    """A group column value's place in the key: one hash block, the same for equal values."""
    text = json.dumps(value, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=HASH_BYTES).digest()


def adapter_key(name: str | None, hashes: dict[str, bytes]) -> tuple[bytes, RequestExtras]:
    """A row's adapter's place in its key (one hash block, first: each adapter's rows sort together,
    the base model's first) and the extras its blocks hash with (core/block_hash: the one rule)."""
    if name is None:
        return bytes(HASH_BYTES), NO_EXTRAS
    content = hashes[name]
    return hashlib.blake2b(content, digest_size=HASH_BYTES).digest(), RequestExtras(adapter_hash=content)


def plan_cut(
    spec: JobSpec, files: list[InputFile], tokenizer: Any, block_size: int, adapters: dict[str, bytes] | None = None
) -> Cut:
    """The job's parts: every planned row (input.limit respected), those sharing a prefix in key
    order, the others in input order, cut by window_rows. `adapters`: name -> content hash of the
    job's LoRA adapters (model.lora): a row's key starts with its adapter's (adapter_key)."""
    preparer = RowPreparer(spec, tokenizer, 1 << 62)
    group = spec.input.group_column
    with tempfile.TemporaryDirectory(prefix="batchgen-plan-") as folder:
        sorter = KeySorter(folder)
        offsets = file_offsets(files)
        images = preparer.vision is not None
        chunks = plan_shards(files, IMAGE_READ_ROWS if images else READ_ROWS, spec.input.limit)
        max_chars = (KEY_BLOCKS * block_size + CUT_MARGIN) * CHARS_PER_KEY_TOKEN
        for shard, table in read_shards(files, chunks, key_columns(spec)):
            where = image_folder(files[shard.file_index]) if images else None
            prompts = preparer.prompt_ids(table, max_chars, where)
            if adapters:
                keys = _adapter_keys(spec, table, prompts, block_size, adapters)
            else:
                keys = [
                    prompt_key(ids, block_size, cut, row.extras() if images else NO_EXTRAS) for ids, cut, row in prompts
                ]
            if group is not None:
                keys = [group_key(v) + k for v, k in zip(table.column(group).to_pylist(), keys)]
            sorter.add(keys, int(offsets[shard.file_index]) + shard.start)
        cut = plan_parts(sorter, spec.engine.window_rows)
    log.info("prefix plan: %d rows in %d parts (%d spilled runs)", len(cut.rows), len(cut.starts) - 1, len(sorter.runs))
    return cut


def _adapter_keys(
    spec: JobSpec,
    table: Any,
    prompts: list[tuple[list[int] | None, bool, PreparedRow]],
    block_size: int,
    hashes: dict[str, bytes],
) -> list[bytes]:
    """Keys of rows that name adapters: the adapter's block, then the prompt's blocks hashed under
    it (and its images); a row naming an adapter the job lacks is no request (it becomes an error row)."""
    keys = []
    for (ids, cut, row), (name, problem) in zip(prompts, row_adapters(spec, table)):
        if problem is not None:
            keys.append(NO_REQUEST)
            continue
        head, extras = adapter_key(name, hashes)
        if row.images:
            extras = dataclasses.replace(row.extras(), adapter_hash=extras.adapter_hash)
        keys.append(head + prompt_key(ids, block_size, cut, extras))
    return keys
