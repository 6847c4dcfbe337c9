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
    if family == "qwen2_vl":
        return _qwen2_vl_tokens(processor.image_processor, width, height)
    counts = processor._get_num_multimodal_tokens(image_sizes=[(height, width)])
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
    """Qwen2-VL: the image is resized to a multiple of patch*merge within the pixel bounds; one
    token per merge x merge patches."""
    patches = image_processor.get_number_of_image_patches(height, width, {})
    return int(patches) // int(image_processor.merge_size) ** 2
