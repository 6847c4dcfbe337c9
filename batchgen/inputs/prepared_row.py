"""PreparedRow: one input row as the engine will get it (token ids, sampling params, images) or as
an error row (code and message naming the row).

Why its own module: preparation (inputs/prepare) makes it, ordering, estimate, the part writers
and the output table read it; none of them needs the preparer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras
from batchgen.inputs.image_cells import ImageData


@dataclass
class PreparedRow:
    """One input row, ready for the engine (prompt_ids and params set) or failed (error set)."""

    prompt_ids: list[int] | None = None
    params: SamplingParams | None = None
    error_code: str | None = None
    error_message: str | None = None
    label: str = ""  # names the row in messages: file, row index, id (see row_labels)
    adapter: str | None = None  # the LoRA adapter the row names (model.lora); None: the base model
    unreadable: bool = False  # its input line did not parse: that, not its (null) id, is its error
    images: list[ImageData] | None = None  # an image job's row: its images (compressed bytes, never pixels)
    image_positions: list[tuple[int, int]] | None = None  # (first position, count) of each image's tokens
    placeholder_ids: list[int] | None = None  # the prompt with one image token per image (the engine expands)

    @property
    def ok(self) -> bool:
        return self.error_code is None

    def request(self) -> tuple[list[int], SamplingParams]:
        """(prompt ids, params) of an ok row; an error row has no request."""
        if self.prompt_ids is None or self.params is None:
            raise ValueError(f"an error row ({self.error_code}) has no request")
        return self.prompt_ids, self.params

    def engine_prompt(self) -> list[int] | dict[str, Any]:
        """What the engine is handed: the ids, or with images vLLM's {"prompt_token_ids",
        "multi_modal_data"} with each image as a LazyImage (decoded when the engine reaches it)."""
        ids, _ = self.request()
        if not self.images:
            return ids
        images = [image.open() for image in self.images]
        return {"prompt_token_ids": self.placeholder_ids, "multi_modal_data": {"image": images}}

    def extras(self) -> RequestExtras:
        """The request's RequestExtras for its block hashes (its images' content hashes and positions)."""
        if not self.images or self.image_positions is None:
            return NO_EXTRAS
        hashes = tuple(image.content_hash for image in self.images)
        return RequestExtras(image_hashes=hashes, image_positions=tuple(self.image_positions))

    def fail(self, code: str, message: str) -> None:
        """Make this an error row: `code` goes to error_code, `message` (naming the row) to error_message."""
        self.error_code, self.error_message = code, message
