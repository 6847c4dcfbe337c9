"""How many tokens an image of a given size becomes: the processor's arithmetic, no pixels, no
weights. The job's `estimate` counts image tokens with it before any model loads, and the engine
expands each image placeholder to exactly this many tokens.
"""

from __future__ import annotations

from typing import Any


def image_token_count(processor: Any, width: int, height: int) -> int:
    """Tokens an image of `width` x `height` pixels takes in the prompt of `processor`'s model.

    `processor`: a batchgen VisionProcessor (vision/processor.load_vision_processor), or any
    transformers processor that implements `_get_num_multimodal_tokens`.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    family = getattr(processor, "family", None)
    if family == "llava":
        return _llava_tokens(processor)
    if family == "gemma3":  # every image is resized to one square: a fixed count (pan-and-scan is not used)
        return int(processor.options.get("image_seq_length") or 256)
    if family == "qwen2_vl":
        return _qwen2_vl_tokens(processor.image_processor, width, height)
    hf = getattr(processor, "hf", None) or processor  # LLaVA-NeXT: transformers' own tiling arithmetic
    counts = hf._get_num_multimodal_tokens(image_sizes=[(height, width)])
    return int(counts.num_image_tokens[0])


def _llava_tokens(processor: Any) -> int:
    """LLaVA: every image is resized and cropped to one crop; a token per patch (+ CLS unless the
    model's feature strategy drops it)."""
    crop = processor.image_processor.crop_size
    crop_h, crop_w = (crop["height"], crop["width"]) if isinstance(crop, dict) else (crop.height, crop.width)
    patch = int(processor.options.get("patch_size") or 14)
    count = (crop_h // patch) * (crop_w // patch) + int(processor.options.get("num_additional_image_tokens") or 0)
    if processor.options.get("vision_feature_select_strategy") == "default":
        count -= 1
    return count


def _qwen2_vl_tokens(image_processor: Any, width: int, height: int) -> int:
    """Qwen2-VL: one token per merge x merge patches of the resized image (see qwen2_vl_grid)."""
    rows, cols = qwen2_vl_grid(image_processor, width, height)
    return rows * cols


def qwen2_vl_grid(image_processor: Any, width: int, height: int) -> tuple[int, int]:
    """Qwen2-VL's token grid (rows, columns) of an image: resized to multiples of patch * merge
    within the processor's pixel bounds (its own smart_resize), one token per merge x merge patches."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    patch, merge = int(image_processor.patch_size), int(image_processor.merge_size)
    size = image_processor.size
    low = size["shortest_edge"] if isinstance(size, dict) else size.shortest_edge
    high = size["longest_edge"] if isinstance(size, dict) else size.longest_edge
    resized_h, resized_w = smart_resize(height, width, patch * merge, min_pixels=low, max_pixels=high)
    return resized_h // (patch * merge), resized_w // (patch * merge)


def placeholder_tokens(processor: Any, width: int, height: int) -> int:
    """Tokens one image's placeholder token becomes in the expanded prompt: its image tokens plus
    what wraps them (Gemma 3: "\\n\\n<start_of_image>" before, "<end_of_image>\\n\\n" after; the
    other families: nothing). A prompt's input tokens = its tokens as written, minus one per
    placeholder, plus this per image (what `estimate` counts before any weights load)."""
    before, after = getattr(processor, "wrap", ((), ()))
    return len(before) + image_token_count(processor, width, height) + len(after)
