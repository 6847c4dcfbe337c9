"""Tiny random-weight vision-language models, saved WITH their processors (tokenizer, image
processor, chat template), built offline from configs: the image tests, the vision benchmark and
the job-side tests load them exactly as a user's checkpoint folder is loaded.

Why a module of its own (beside tiny_models): a VLM folder needs more than weights and a word
tokenizer: the tokenizer must know the model's image placeholder tokens, the image processor must
agree with the tower's patch size, and the processor's chat template renders OpenAI-style content
parts. Each family is small (2 text layers, hidden 64, tower hidden 32, images of a few dozen
tokens) so a test builds and runs one in seconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchgen.engine.vision.processor import PLACEHOLDERS, vision_family
from testkit.tiny_models import EOS_ID, MAX_POS

VOCAB = 256
# Special tokens take the top ids; words fill the rest ("w{i}" <-> id i, as in tiny_models).
SPECIALS: dict[str, list[str]] = {
    "llava": ["<image>"],
    "llava_next": ["<image>"],
    "gemma3": ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "qwen2_5_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
}
FAMILIES = tuple(SPECIALS)
GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64]]  # LLaVA-NeXT's tilings of 32-pixel tiles
# The CLIP (LLaVA, LLaVA-NeXT) and SigLIP (Gemma 3) towers: 32-pixel images of 8-pixel patches.
TOWER: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
)

# Renders OpenAI content parts (a string, or a list of {"type": "text"|"image"|"image_url"|...})
# with the family's image placeholder where each image goes.
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:"
    "{% if message['content'] is string %} {{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %} {{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url', 'image_pil') %} IMAGE_PLACEHOLDER"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def special_ids(family: str) -> dict[str, int]:
    """Special token -> id for `family` (top of the vocabulary)."""
    names = SPECIALS[family]
    return {name: VOCAB - len(names) + i for i, name in enumerate(names)}


def vision_tokenizer(family: str) -> Any:
    """The word tokenizer of tiny_models with `family`'s image tokens as special tokens; the words
    "user:", "assistant:" and "IMAGE"-free chat text tokenize to <unk> or words."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = special_ids(family)
    words = {"<eos>": EOS_ID, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB - len(specials))}}
    words.update(specials)
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    extra: dict[str, Any] = {}
    if family == "gemma3":  # the processor reads these names off the tokenizer
        extra["extra_special_tokens"] = {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>", **extra
    )


def tiny_vision_config(family: str) -> Any:
    """`family`'s tiny config: tower and text model both a few layers wide."""
    import transformers as tf

    ids = special_ids(family)
    text: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        initializer_range=0.25,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        tie_word_embeddings=False,
    )
    if family in ("llava", "llava_next"):  # a CLIP tower; LLaVA-NeXT tiles each image over GRID_PINPOINTS
        config_class: Any = tf.LlavaConfig if family == "llava" else tf.LlavaNextConfig
        extra = {"projector_hidden_act": "gelu"} if family == "llava" else {"image_grid_pinpoints": GRID_PINPOINTS}
        return config_class(
            vision_config=tf.CLIPVisionConfig(**TOWER),
            text_config=tf.LlamaConfig(**text),
            image_token_index=ids["<image>"],
            vision_feature_select_strategy="default",
            vision_feature_layer=-2,
            tie_word_embeddings=False,
            **extra,
        )
    if family == "gemma3":
        gemma_text = dict(
            text,
            head_dim=16,
            sliding_window=12,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        )
        return tf.Gemma3Config(
            text_config=tf.Gemma3TextConfig(**gemma_text),
            vision_config=tf.SiglipVisionConfig(**TOWER),
            mm_tokens_per_image=4,
            boi_token_index=ids["<start_of_image>"],
            eoi_token_index=ids["<end_of_image>"],
            image_token_index=ids["<image_soft_token>"],
            tie_word_embeddings=False,
        )
    if family in ("qwen2_vl", "qwen2_5_vl"):
        vision: dict[str, Any] = dict(
            depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
            temporal_patch_size=2,
        )  # fmt: skip
        text_cfg = dict(
            text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
        )
        if family == "qwen2_5_vl":  # windowed tower: 16-pixel windows, the last block attends fully
            vision.update(intermediate_size=64, out_hidden_size=64, hidden_size=32, window_size=16)
            vision.update(fullatt_block_indexes=[1])
            for key in ("embed_dim", "mlp_ratio"):
                vision.pop(key)
        qwen_class: Any = tf.Qwen2_5_VLConfig if family == "qwen2_5_vl" else tf.Qwen2VLConfig
        return qwen_class(
            text_config=text_cfg,
            vision_config=vision,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"],
            vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown tiny vision family {family!r}; known: {', '.join(FAMILIES)}")


def save_tiny_processor(family: str, path: Path) -> None:
    """`family`'s processor files (tokenizer, image processor, chat template; LLaVA also its
    processor_config.json) saved to `path`, built offline, laid out as the published checkpoints.
    Qwen2-VL's is saved part by part: transformers' combined processor needs torchvision."""
    import transformers as tf

    template = _CHAT_TEMPLATE.replace("IMAGE_PLACEHOLDER", PLACEHOLDERS[vision_family(family) or family])
    tokenizer = vision_tokenizer(family)
    if family in ("llava", "llava_next"):
        crop: dict[str, Any] = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}}
        processor_class: Any
        images: Any
        if family == "llava":
            processor_class, images = tf.LlavaProcessor, tf.CLIPImageProcessor(**crop)
        else:
            processor_class = tf.LlavaNextProcessor
            images = tf.LlavaNextImageProcessor(**crop, image_grid_pinpoints=GRID_PINPOINTS)
        processor_class(
            image_processor=images,
            tokenizer=tokenizer,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            chat_template=template,
        ).save_pretrained(path)
    elif family == "gemma3":
        squares = tf.Gemma3ImageProcessor(size={"height": 32, "width": 32})
        tf.Gemma3Processor(
            image_processor=squares, tokenizer=tokenizer, chat_template=template, image_seq_length=4
        ).save_pretrained(path)
    elif family in ("qwen2_vl", "qwen2_5_vl"):
        # 4-pixel patches merged 2x2: one token per 8x8 pixels; between 4 and 64 tokens an image.
        qwen_images = tf.Qwen2VLImageProcessor(
            patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64}
        )
        qwen_images.save_pretrained(path)
        tokenizer.save_pretrained(path)
        (Path(path) / "chat_template.jinja").write_text(template)
    else:
        raise ValueError(f"unknown tiny vision family {family!r}; known: {', '.join(FAMILIES)}")


def save_tiny_vlm(family: str, path: Path, seed: int = 0) -> Path:
    """A random-weight `family` model saved to `path` with its processor files; EOS = id 0."""
    import torch
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(tiny_vision_config(family))
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    if family == "gemma3":  # why: its projection starts at zeros, which would make every image the same
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.25)
    model.save_pretrained(path)
    save_tiny_processor(family, path)
    return path


def sample_image(width: int, height: int, seed: int = 0) -> Any:
    """A deterministic RGB test image of the given size (random pixels)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8), "RGB")


def image_prompts(placeholder: str) -> list[dict[str, Any]]:
    """Five prompts: one image, two images of other sizes, the first image again with the same
    leading text (a prefix hit), no image between text, and an image at the very start."""
    a, b, c = sample_image(40, 24, 1), sample_image(64, 64, 2), sample_image(20, 50, 3)
    return [
        {"prompt": f"w5 {placeholder} w7 w8", "multi_modal_data": {"image": a}},
        {"prompt": f"w9 {placeholder} w3 {placeholder} w4", "multi_modal_data": {"image": [b, c]}},
        {"prompt": f"w5 {placeholder} w7 w9 w10", "multi_modal_data": {"image": a}},
        {"prompt": f"{placeholder} w11", "multi_modal_data": {"image": [c]}},
        {"prompt": f"w12 w13 {placeholder}", "multi_modal_data": {"image": b}},
    ]
