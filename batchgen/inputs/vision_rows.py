"""Rows of an image job (`input.image_column`) as the engine will see them: each row's images read
(image_cells: compressed bytes, header, content hash), its text rendered as one user turn
`[image(s), text]` through the model's chat template (a model without one: the image
placeholder(s), then the text), tokenized, and each image's placeholder expanded to the tokens the
processor's arithmetic gives its size (engine/vision/token_counts). No pixel is decoded here.

Why expanded here: the expanded ids are the prompt the model sees, so they are what the row's
length check, `input_tokens`, `estimate` and the prefix key (with each image's content hash at its
positions: the block hash's one rule) count. The engine receives these ids with the images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from batchgen.inputs.image_cells import CellError, Folder, ImageData, ImageReader
from batchgen.job.spec import JobSpec
from batchgen.storage.uris import uri_scheme


@dataclass(frozen=True)
class ImagePrompt:
    """A row's prompt with its images: expanded ids, images, and (first position, count) of each."""

    ids: list[int]
    images: list[ImageData]
    positions: list[tuple[int, int]]
    placeholder_ids: list[int]  # before expansion: one image token per image (what the engine is handed)


class VisionRows:
    """Renders and expands image rows for one job; loaded once per process (RowPreparer)."""

    def __init__(self, spec: JobSpec, processor: Any) -> None:
        self.spec, self.processor = spec, processor
        scheme = uri_scheme(spec.input.path)
        self.reader = ImageReader(spec.input.max_image_pixels, spec.input.storage_options, scheme)
        self.counts: dict[tuple[int, int], int] = {}  # (width, height) -> tokens: sizes repeat

    @classmethod
    def load(cls, spec: JobSpec) -> VisionRows:
        from batchgen.engine.vision.processor import load_vision_processor

        return cls(spec, load_vision_processor(spec.model.path))

    def fill(
        self,
        table: pa.Table,
        texts: dict[int, str],
        rows: list[Any],
        labels: list[str],
        folders: Sequence[Folder | None] | None,
        message_images: dict[int, list[ImageData]],
        templated: set[int],
    ) -> dict[int, list[int]]:
        """The expanded ids of each row of `texts`; each row's images and their positions set on
        `rows[i]` (PreparedRow); a row whose image cannot be used fails. With input.image_column,
        texts[i] is the user's text and the images are its cell's; else texts[i] is the rendered
        prompt (`templated`: by a chat template) and `message_images[i]` its messages' images."""
        column = self.spec.input.image_column
        cells = table.column(column).to_pylist() if column is not None else []
        encoded: dict[int, list[int]] = {}
        self.reader.forget_locations()
        for i, text in texts.items():
            try:
                if column is not None:
                    prompt = self.prompt(text, cells[i], folders[i] if folders is not None else None)
                else:
                    ids = self._ids(text, i in templated)
                    prompt = self.expand(ids, message_images.get(i, []))
            except CellError as exc:
                rows[i].fail(exc.code, f"{labels[i]}: column {column!r}: {exc}" if labels[i] else str(exc))
                continue
            rows[i].images, rows[i].image_positions = prompt.images, prompt.positions
            rows[i].placeholder_ids = prompt.placeholder_ids
            encoded[i] = prompt.ids
        return encoded

    def prompt(self, text: str, cell: Any, folder: Folder | None) -> ImagePrompt:
        """The row's prompt; CellError for an image that cannot be used."""
        images = self.reader.read_cell(cell, folder)
        ids = self._ids(self.render(text, len(images)), bool(self.processor.chat_template))
        return self.expand(ids, images)

    def conversation(self, value: Any, folder: Folder | None) -> tuple[str, list[ImageData]]:
        """A messages cell (OpenAI content parts allowed) rendered through the model's chat template
        with a placeholder per image part, and those images, in order."""
        from batchgen.inputs.content_parts import split_parts

        messages, sources = split_parts(value)
        images = [self.reader.image(j, source, folder) for j, source in enumerate(sources)]
        return self._template(messages), images

    def render(self, text: str, num_images: int) -> str:
        """One user turn [image x num_images, text] as the model's prompt text."""
        p = self.processor
        if not p.chat_template:
            return p.placeholder * num_images + "\n" + text
        parts: list[dict[str, str]] = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
        return self._template([{"role": "user", "content": parts}])

    def _template(self, messages: list[dict[str, Any]]) -> str:
        p = self.processor
        if not p.chat_template:
            raise CellError("invalid_messages", "the model has no chat template to render messages with")
        try:
            rendered = p.tokenizer.apply_chat_template(
                messages, chat_template=p.chat_template, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # the template is user data too: its failure is this row's
            raise CellError("invalid_messages", f"chat template failed: {exc}") from exc
        return str(rendered)

    def _ids(self, rendered: str, templated: bool) -> list[int]:
        # why no special tokens with a template: the rendered template already holds them (BOS etc.)
        return list(self.processor.tokenizer(rendered, add_special_tokens=not templated)["input_ids"])

    def expand(self, ids: list[int], images: list[ImageData]) -> ImagePrompt:
        """`ids` with the k-th image placeholder replaced by image k's tokens (wrapped as the family
        wraps them: Gemma 3's begin/end of image), as engine/vision/prompts.expand_images does at
        add time; its rotary positions are the engine's business, not the job's."""
        p = self.processor
        placeholder = p.placeholder_id if p.placeholder_id >= 0 else p.image_token_id
        before, after = p.wrap
        found = sum(1 for t in ids if t == placeholder)
        if found != len(images):
            why = f"the prompt holds {found} image placeholder(s) for {len(images)} image(s)"
            raise CellError("invalid_image", f"{why} (the text may not contain {p.placeholder!r})")
        out: list[int] = []
        positions: list[tuple[int, int]] = []
        k = 0
        for t in ids:
            if t != placeholder:
                out.append(t)
                continue
            count = self.count(images[k].width, images[k].height)
            out.extend(before)
            positions.append((len(out), count))
            out.extend([p.image_token_id] * count)
            out.extend(after)
            k += 1
        return ImagePrompt(out, images, positions, ids)

    def count(self, width: int, height: int) -> int:
        """Tokens an image of this size becomes (the processor's arithmetic, cached per size)."""
        known = self.counts.get((width, height))
        if known is None:
            from batchgen.engine.vision.token_counts import image_token_count

            known = self.counts[(width, height)] = image_token_count(self.processor, width, height)
        return known


def reads_images(spec: JobSpec) -> bool:
    """Whether the job's rows carry images: an image column, or messages (a messages column or
    OpenAI chat requests, whose content parts may hold images) for a vision-language model."""
    if spec.input.image_column is not None:
        return True
    if spec.input.messages_column is None and spec.input.format != "openai_batch":
        return False
    import json

    from batchgen.engine.vision.processor import vision_family

    try:
        config = json.loads((Path(spec.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return False  # (the model's own checks name that problem)
    return isinstance(config, dict) and vision_family(str(config.get("model_type", ""))) is not None


def wave_rows(spec: JobSpec) -> int:
    """Rows of grouped parts read at a time (part_rows.read_parts): about one part for a job whose
    rows carry images (their encoded bytes are in the rows), else part_rows.WAVE_ROWS."""
    from batchgen.inputs.part_rows import IMAGE_WAVE_ROWS, WAVE_ROWS

    return IMAGE_WAVE_ROWS if reads_images(spec) else WAVE_ROWS


def input_folder(path: Any, filesystem: Any = None, fs_path: str = "") -> Folder:
    """The Folder a relative image path in an input file resolves against: the file's own folder."""
    if filesystem is None:
        return Folder(str(Path(path).parent))
    return Folder(fs_path.rsplit("/", 1)[0], filesystem, str(path))
