"""A multimodal prompt at add time: each image's placeholder token expanded to the image's token
count, where each image's embeddings go, and (Qwen2-VL) the three rotary position axes of every
prompt token; all of it becomes the request's RequestExtras, so the block hashes cover the images
and the runner side knows where to splice.

Why at add time and from the header only: the token count comes from the processor's arithmetic
on the image's size (vision/token_counts), so no pixels are decoded before the request runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchgen.engine.core.sequence import RequestExtras
from batchgen.engine.vision.images import RequestImage
from batchgen.engine.vision.processor import VisionProcessor
from batchgen.engine.vision.token_counts import image_token_count, qwen2_vl_grid


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt with its images expanded: its token ids and its extras (the images among them)."""

    token_ids: list[int]
    extras: RequestExtras


def expand_images(
    processor: VisionProcessor, token_ids: list[int], images: list[RequestImage], where: str
) -> ImagePrompt:
    """`token_ids` holding one image token per image (the prompt's placeholders, in order) ->
    the prompt with each expanded to its image's token count; ValueError naming `where` when the
    placeholders and the images do not match."""
    token = processor.image_token_id
    placeholder = processor.placeholder_id if processor.placeholder_id >= 0 else token
    before, after = processor.wrap
    slots = [i for i, t in enumerate(token_ids) if t == placeholder]
    if len(slots) != len(images):
        raise ValueError(
            f"{where}: the prompt has {len(slots)} image placeholder(s) ({processor.placeholder!r}) "
            f"but {len(images)} image(s) were given"
        )
    out: list[int] = []
    positions: list[tuple[int, int]] = []
    last = 0
    for slot, image in zip(slots, images):
        out.extend(token_ids[last:slot])
        count = image_token_count(processor, image.width, image.height)
        out.extend(before)
        positions.append((len(out), count))
        out.extend([token] * count)
        out.extend(after)
        last = slot + 1
    out.extend(token_ids[last:])
    rotary = mrope_positions(processor, len(out), positions, images) if processor.family == "qwen2_vl" else ()
    extras = RequestExtras(
        image_hashes=tuple(i.content_hash for i in images),
        image_positions=tuple(positions),
        rotary_positions=rotary,
        images=tuple(images),
        image_pixels=tuple(i.width * i.height for i in images),
        atomic_images=processor.family == "gemma3",
    )
    return ImagePrompt(out, extras)


def mrope_positions(
    processor: VisionProcessor, num_tokens: int, positions: list[tuple[int, int]], images: list[RequestImage]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Qwen2-VL's M-RoPE positions of a prompt, [3 axes][tokens] (temporal, height, width): text
    advances all three together; an image's tokens take (p, p + row, p + column) from the text
    position p where it starts, and the text after it resumes at p + max(rows, columns)."""
    axes: list[list[int]] = [[], [], []]
    next_pos, i = 0, 0
    for (start, count), image in zip(positions, images):
        for p in range(next_pos, next_pos + start - i):  # the text before this image
            for axis in axes:
                axis.append(p)
        next_pos += start - i
        rows, cols = qwen2_vl_grid(processor.image_processor, image.width, image.height)
        if rows * cols != count:
            raise RuntimeError(f"image {image.index}: grid {rows}x{cols} != {count} tokens")
        for r in range(rows):
            for c in range(cols):
                axes[0].append(next_pos)
                axes[1].append(next_pos + r)
                axes[2].append(next_pos + c)
        next_pos += max(rows, cols)
        i = start + count
    for p in range(next_pos, next_pos + num_tokens - i):
        for axis in axes:
            axis.append(p)
    return tuple(axes[0]), tuple(axes[1]), tuple(axes[2])


def rotary_delta(extras: RequestExtras, num_prompt_tokens: int) -> int:
    """What a generated token adds to its index for its (three equal) M-RoPE positions: the
    prompt's last position + 1 - its length. A function of the request alone, so it survives
    preemption (a recomputation derives the same positions)."""
    return max(max(axis) for axis in extras.rotary_positions) + 1 - num_prompt_tokens
