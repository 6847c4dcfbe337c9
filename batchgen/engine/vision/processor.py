"""The image side of a VLM checkpoint folder: its tokenizer, image processor, chat template and
the family's placeholder rule, loaded from the folder's files without building transformers'
combined processor.

Why not `AutoProcessor`: transformers' Qwen2-VL processor also builds a video processor, which
needs torchvision; batchgen reads images only, so it loads the parts it uses (the same files, the
same classes) and applies each family's placeholder arithmetic itself (vision/token_counts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model_type -> family; a family fixes the placeholder rule and the tower glue.
FAMILIES = {
    "llava": "llava",
    "llava_next": "llava_next",
    "gemma3": "gemma3",
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_vl",
}
# What a prompt writes per image (vLLM's prompts use the same strings).
PLACEHOLDERS = {
    "llava": "<image>",
    "llava_next": "<image>",
    "gemma3": "<start_of_image>",
    "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>",
}
# The token repeated once per image embedding.
IMAGE_TOKENS = {
    "llava": "<image>",
    "llava_next": "<image>",
    "gemma3": "<image_soft_token>",
    "qwen2_vl": "<|image_pad|>",
}


@dataclass
class VisionProcessor:
    """What the engine and the job side need to turn (text, images) into token ids."""

    family: str
    tokenizer: Any
    image_processor: Any
    chat_template: str | None
    image_token: str
    image_token_id: int
    placeholder: str
    options: dict[str, Any] = field(default_factory=dict)  # processor_config.json (LLaVA: patch_size, ...)
    placeholder_id: int = -1  # the token a prompt holds per image (-1: the image token itself)
    wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # ids around an expanded image (Gemma 3: boi, eoi)
    hf: Any = None  # transformers' own processor, where it builds without torchvision (LLaVA-NeXT's arithmetic)


def vision_family(model_type: str) -> str | None:
    """The family of a config's model_type, or None when it is not a supported VLM."""
    return FAMILIES.get(model_type)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _chat_template(folder: Path, tokenizer: Any) -> str | None:
    """The folder's chat template: chat_template.jinja, chat_template.json, processor_config.json,
    then the tokenizer's own."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    for name in ("chat_template.json", "processor_config.json"):
        template = _read_json(folder / name).get("chat_template")
        if template:
            return str(template)
    return getattr(tokenizer, "chat_template", None)


def load_vision_processor(model_path: str | Path) -> VisionProcessor:
    """The VisionProcessor of the checkpoint folder `model_path` (no weights are read)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = Path(model_path)
    config = _read_json(folder / "config.json")
    model_type = config.get("model_type", "")
    family = vision_family(model_type)
    if family is None:
        raise ValueError(f"{folder}: model_type {model_type!r} is not a supported vision-language model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = AutoImageProcessor.from_pretrained(folder)
    token = IMAGE_TOKENS[family]
    token_id: Any = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"{folder}: the tokenizer has no image token {token!r}")
    placeholder_id, wrap = int(token_id), ((), ())
    if family == "gemma3":  # "<start_of_image>" becomes "\n\n<start_of_image>" + image tokens + "<end_of_image>\n\n"
        ids: Any = tokenizer.convert_tokens_to_ids(["<start_of_image>", "<end_of_image>"])
        placeholder_id, end = int(ids[0]), int(ids[1])
        blank = list(tokenizer("\n\n", add_special_tokens=False)["input_ids"])
        wrap = ((*blank, placeholder_id), (end, *blank))
    return VisionProcessor(
        family=family,
        placeholder_id=placeholder_id,
        wrap=wrap,
        tokenizer=tokenizer,
        image_processor=image_processor,
        chat_template=_chat_template(folder, tokenizer),
        image_token=token,
        image_token_id=int(token_id),
        placeholder=PLACEHOLDERS[family],
        options=_options(folder, config),
        hf=_hf_processor(folder) if family == "llava_next" else None,
    )


def _options(folder: Path, config: dict[str, Any]) -> dict[str, Any]:
    """processor_config.json, with what older LLaVA folders leave out taken from the model's config
    (the tower's patch size; a CLIP tower's CLS token; the feature strategy), as their models count."""
    options = _read_json(folder / "processor_config.json")
    vision = config.get("vision_config") or {}
    options.setdefault("patch_size", vision.get("patch_size", 14))
    options.setdefault("vision_feature_select_strategy", config.get("vision_feature_select_strategy", "default"))
    options.setdefault(
        "num_additional_image_tokens", int(vision.get("model_type", "clip_vision_model") == "clip_vision_model")
    )
    return options


def _hf_processor(folder: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(folder)
