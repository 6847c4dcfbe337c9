"""Rows to engine requests: validate each row, render chat templates, tokenize in batches, build
per-row SamplingParams. A bad row becomes an error row here; it never stops the job.

The input token count is fixed here: it is the first half of the bill. What a row becomes is
inputs/prepared_row; the value checks (prompt text, messages, sampling values, seeds) are
inputs/row_values; an image job's rows go through inputs/vision_rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.engine.api.params import SamplingParams
from batchgen.errors import ModelError
from batchgen.inputs.adapter_column import UNKNOWN_ADAPTER, adapter_column, row_adapters
from batchgen.inputs.dataset import InputFile
from batchgen.inputs.duplicate_ids import IdProblem
from batchgen.inputs.image_cells import CellError, Folder, ImageData
from batchgen.inputs.part_rows import PartRows
from batchgen.inputs.prepared_row import PreparedRow
from batchgen.inputs.row_names import row_ids, row_keys, row_labels
from batchgen.inputs.row_values import (
    RowError,
    asked_logprobs,
    check_messages,
    column_values,
    decode_prompt,
    row_seed,
    whole,
)
from batchgen.inputs.text_formats import line_problems
from batchgen.job.sections import SCHEMA_COLUMN_KEY
from batchgen.job.spec import JobSpec


def input_columns(spec: JobSpec) -> list[str]:
    """Columns the job must read from every input file."""
    i = spec.input
    names = [i.prompt_column or i.messages_column, i.image_column, i.id_column, *i.sampling_columns.values()]
    if i.format == "openai_batch":  # a chat request's messages, a completion's prompt, and which it is
        names += ["messages", "url", "json_schema", "logprobs_requested", "dimensions"]
    if spec.pooling is not None and spec.pooling.document_column is not None:  # score pairs' second text
        names.append(spec.pooling.document_column)
    names.append(adapter_column(spec))  # the row's LoRA adapter (None: the job has none)
    return [n for n in dict.fromkeys(names) if n is not None]


def load_tokenizer(model_path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelError(f"model.path {model_path}: cannot load a tokenizer: {exc}") from exc
    # Why: a prompt longer than the context is batchgen's own prompt_too_long row, counted and
    # reported; transformers' "Token indices sequence length is longer than the specified maximum"
    # warning (once, when such a prompt is tokenized) only alarms. This flag is how it keeps it once.
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(warned, dict):
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


class RowPreparer:
    """Turns a shard's table into PreparedRows, in the table's row order."""

    def __init__(self, spec: JobSpec, tokenizer: Any, max_model_len: int) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.base_params = spec.sampling.model_dump()
        self._schemas: dict[str, Any] = {}  # schema text -> structured spec, or the RowError it makes
        self._templated: set[int] = set()  # OpenAI batch rows of this table rendered by the chat template
        from batchgen.inputs.vision_rows import VisionRows, reads_images

        # images: an image column, or a vision model's messages (their OpenAI image content parts)
        self.vision = VisionRows.load(spec) if reads_images(spec) else None
        self._folders: Sequence[Folder | None] | None = None  # this table's rows' image folders
        self._message_images: dict[int, list[ImageData]] = {}  # row -> images of its messages' parts

    def prepare(
        self, table: pa.Table, labels: list[str], keys: list[str], folders: list[Folder] | None = None
    ) -> list[PreparedRow]:
        """`labels[i]` names row i in messages (file, row index, id); `keys[i]` identifies it
        across runs (see row_keys): the run seed is combined with it. `folders[i]`: where row i's
        relative image paths resolve (image jobs)."""
        rows = [PreparedRow(label=label) for label in labels]
        for i, code, message in line_problems(table):  # a line that did not parse fails first
            rows[i].fail(code, f"{labels[i]}: {message}")
            rows[i].unreadable = True
        self._folders = folders
        texts = self._texts(table, rows, labels)
        if self.vision is not None:
            self._image_prompts(table, texts, rows, labels, folders)
        else:
            self._tokenize(texts, rows, labels)
        self._sampling(table, rows, labels, keys)
        for i, (adapter, problem) in enumerate(row_adapters(self.spec, table)):
            rows[i].adapter = adapter
            if problem is not None and rows[i].ok:
                rows[i].fail(UNKNOWN_ADAPTER, f"{labels[i]}: {problem}")
        return rows

    def prepare_part(
        self, files: list[InputFile], part: PartRows, duplicates: dict[tuple[int, int], IdProblem]
    ) -> list[PreparedRow]:
        """Prepare a part's rows; a repeated id (see duplicate_ids) fails, its first use is served; a null id fails."""
        labels = row_labels(self.spec, files, part.file_index, part.file_row, part.table)
        ids = row_ids(files, part.file_index, part.file_row)
        folders = [image_folder(files[f]) for f in part.file_index] if self.vision is not None else None
        rows = self.prepare(part.table, labels, row_keys(self.spec, part.table, ids), folders)
        for i, row in enumerate(rows):
            problem = duplicates.get((part.file_index[i], part.file_row[i]))
            if problem is not None and not row.unreadable:
                row.fail(problem.code, f"{labels[i]}: {problem.message}")
                row.prompt_ids = None
        return rows

    def prompt_ids(
        self, table: pa.Table, max_chars: int, folder: Folder | None = None
    ) -> list[tuple[list[int] | None, bool, PreparedRow]]:
        """(token ids, cut, row) of each row's prompt as `prepare` makes it (chat template, special
        tokens; an image job's images expanded, their content hashes on the row: PreparedRow.extras),
        whatever its length; ids None for a row that cannot be a request. Only the prompt's columns
        are read: the prefix plan (batchgen.inputs.grouping) keys every row by them, and needs only
        their first blocks: a rendered prompt longer than `max_chars` characters is tokenized that
        far only (`cut` True; the caller drops the tokens near the cut). `folder`: where the table's
        relative image paths resolve."""
        rows = [PreparedRow() for _ in range(table.num_rows)]
        for i, code, message in line_problems(table):
            rows[i].fail(code, message)
        self._folders = [folder] * table.num_rows
        texts = self._texts(table, rows, [""] * table.num_rows)
        if self.vision is not None and self.spec.input.image_column is None:
            max_chars = 1 << 62  # why: a rendered conversation cut short could lose an image's placeholder
        cut = {i for i, text in texts.items() if len(text) > max_chars}
        texts = {i: text[:max_chars] for i, text in texts.items()}
        limit, self.max_model_len = self.max_model_len, 1 << 62
        try:
            if self.vision is not None:
                self._image_prompts(table, texts, rows, [""] * table.num_rows, [folder] * table.num_rows)
            else:
                self._tokenize(texts, rows, [""] * table.num_rows)
        finally:
            self.max_model_len = limit
        return [(row.prompt_ids if row.ok else None, i in cut, row) for i, row in enumerate(rows)]

    def _image_prompts(
        self,
        table: pa.Table,
        texts: dict[int, str],
        rows: list[PreparedRow],
        labels: list[str],
        folders: Sequence[Folder | None] | None,
    ) -> None:
        """An image job's rows (vision_rows): images read (bytes and header only), text rendered as
        one user turn [images, text], placeholders expanded; a bad image fails its row alone."""
        assert self.vision is not None
        templated = set(texts) if self.spec.input.messages_column is not None else self._templated
        images = self._message_images
        encoded = self.vision.fill(table, texts, rows, labels, folders, images, templated)
        self._message_images = {}
        self._check_lengths(list(encoded), list(encoded.values()), rows, labels)

    def _texts(self, table: pa.Table, rows: list[PreparedRow], labels: list[str]) -> dict[int, str]:
        spec = self.spec.input
        if spec.format == "openai_batch":
            return self._request_texts(table, rows, labels)
        render: Callable[[Any, int], str]
        if spec.prompt_column is not None:
            raw = column_values(table.column(spec.prompt_column), as_bytes=True)
            render = decode_prompt
        else:
            raw = column_values(table.column(spec.messages_column), as_bytes=False)
            render = self._render_messages
        texts: dict[int, str] = {}
        for i, value in enumerate(raw):
            if not rows[i].ok:
                continue
            try:
                texts[i] = render(value, i)
            except RowError as exc:
                rows[i].fail(exc.code, f"{labels[i]}: {exc}")
        return texts

    def _request_texts(self, table: pa.Table, rows: list[PreparedRow], labels: list[str]) -> dict[int, str]:
        """OpenAI batch rows: a chat request's messages through the chat template, else its prompt."""
        prompts = column_values(table.column("prompt"), as_bytes=True)
        messages = table.column("messages").to_pylist()
        from batchgen.inputs.openai_rows import request_problems

        for i, problem in enumerate(request_problems(self.spec, table)):
            if problem is not None and rows[i].ok:
                rows[i].fail(problem[0], f"{labels[i]}: {problem[1]}")
        texts: dict[int, str] = {}
        self._templated = set()
        for i, row in enumerate(rows):
            if not row.ok:
                continue
            try:
                if messages[i] is not None:
                    texts[i] = self._render_messages(messages[i], i)
                    self._templated.add(i)
                else:
                    texts[i] = decode_prompt(prompts[i])
            except RowError as exc:
                row.fail(exc.code, f"{labels[i]}: {exc}")
        return texts

    def _render_messages(self, value: Any, i: int) -> str:
        if self.vision is not None and self.spec.input.image_column is None:  # a vision model's messages
            if isinstance(value, RowError):
                raise value
            folder = self._folders[i] if self._folders is not None else None
            try:
                text, self._message_images[i] = self.vision.conversation(value, folder)
            except CellError as exc:
                raise RowError(exc.code, str(exc)) from None
            return text
        messages = check_messages(value)
        try:
            # why only for generate: a pooling model reads the conversation as it is; the assistant
            # turn's opening tokens would be pooled as if they were content
            reply = self.spec.task == "generate"
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=reply, tokenize=False)
        except Exception as exc:  # the template is user data too: any failure is this row's
            raise RowError("invalid_messages", f"chat template failed: {exc}") from exc

    def _tokenize(self, texts: dict[int, str], rows: list[PreparedRow], labels: list[str]) -> None:
        if not texts:
            return
        # Why: a rendered chat template already holds its special tokens (BOS etc.).
        if self.spec.input.format == "openai_batch":
            templated = self._templated
            groups = [([i for i in texts if i not in templated], True), ([i for i in texts if i in templated], False)]
        else:
            groups = [(list(texts), self.spec.input.prompt_column is not None)]
        for order, add_special in groups:
            if order:
                encoded = self.tokenizer([texts[i] for i in order], add_special_tokens=add_special)["input_ids"]
                self._check_lengths(order, encoded, rows, labels)

    def _check_lengths(
        self, order: list[int], encoded: list[list[int]], rows: list[PreparedRow], labels: list[str]
    ) -> None:
        for i, ids in zip(order, encoded):
            if not ids:
                rows[i].fail("empty_prompt", f"{labels[i]}: prompt has no tokens")
            elif len(ids) >= self.max_model_len:
                context = f"the model's context is {self.max_model_len}"
                rows[i].fail("prompt_too_long", f"{labels[i]}: prompt has {len(ids)} tokens; {context}")
            else:
                rows[i].prompt_ids = list(ids)

    def _sampling(self, table: pa.Table, rows: list[PreparedRow], labels: list[str], keys: list[str]) -> None:
        columns = self.spec.input.sampling_columns
        per_row = {name: table.column(col).to_pylist() for name, col in columns.items()}
        asked = asked_logprobs(table)
        run_seed = self.base_params["seed"]
        for i, row in enumerate(rows):
            if not row.ok:
                continue
            values = dict(self.base_params)
            if run_seed is not None:
                values["seed"] = row_seed(run_seed, keys[i])
            for name, cells in per_row.items():
                if cells[i] is not None and name == SCHEMA_COLUMN_KEY:
                    values["structured"] = self._row_schema(cells[i])
                elif cells[i] is not None:
                    values[name] = whole(name, cells[i])
            k = asked[i]
            if k is not None:  # an OpenAI request's own logprobs (k; the job's when it computes more)
                values["logprobs"] = max(k, values.get("logprobs") or 0)
            if isinstance(values.get("structured"), RowError):
                column = columns[SCHEMA_COLUMN_KEY]
                row.fail("invalid_structured", f"{labels[i]}: column {column!r}: {values['structured']}")
                continue
            try:
                params = SamplingParams(**values)
            except (ValueError, TypeError) as exc:
                row.fail("invalid_sampling", f"{labels[i]}: per-row sampling columns {sorted(columns.values())}: {exc}")
                continue
            # Why: like vLLM, generation stops at the context end ("length") rather than failing;
            # min_tokens follows a max_tokens cut by the context (the user's own min > max failed above).
            room = self.max_model_len - len(row.prompt_ids or [])
            if params.max_tokens is None or params.max_tokens > room:  # None: up to the context
                params.max_tokens, params.min_tokens = room, min(params.min_tokens, room)
            row.params = params

    def _row_schema(self, text: str) -> dict[str, Any] | RowError:
        """A row's JSON schema column value as a structured spec; a RowError when it cannot compile.

        Checked once per distinct text: a million rows sharing three schemas compile three times."""
        known = self._schemas.get(text)
        if known is None:
            from batchgen.engine.sampling.structured import check_structured

            spec = {"json_schema": text}
            problem = check_structured(spec)
            known = spec if problem is None else RowError("invalid_structured", problem)
            self._schemas[text] = known
        return known


def image_folder(f: InputFile) -> Folder:
    """Where the relative image paths of input file `f` resolve: its own folder."""
    from batchgen.inputs.vision_rows import input_folder

    return input_folder(f.path, f.filesystem, f.fs_path)
