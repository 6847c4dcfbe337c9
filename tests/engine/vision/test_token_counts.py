"""image_token_count agrees with what the family's image processing really yields (no weights read)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from batchgen.engine.vision.processor import load_vision_processor
from batchgen.engine.vision.token_counts import image_token_count
from testkit.tiny_vision import sample_image

SIZES = [(40, 24), (64, 64), (200, 30), (8, 8), (513, 97)]


def test_llava_counts_match_transformers_processor(tiny_vlm: Callable[[str], Path]) -> None:
    from transformers import AutoProcessor

    folder = tiny_vlm("llava")
    ours, theirs = load_vision_processor(folder), AutoProcessor.from_pretrained(folder)
    for width, height in SIZES:
        batch = theirs(text=["<image> w5"], images=[sample_image(width, height)])
        expanded = sum(1 for t in batch["input_ids"][0] if t == ours.image_token_id)
        assert image_token_count(ours, width, height) == expanded == 16


def test_llava_next_counts_match_transformers_processor(tiny_vlm: Callable[[str], Path]) -> None:
    from transformers import AutoProcessor

    folder = tiny_vlm("llava_next")
    ours, theirs = load_vision_processor(folder), AutoProcessor.from_pretrained(folder)
    counts = set()
    for width, height in SIZES:
        batch = theirs(text=["<image> w5"], images=[sample_image(width, height)])
        expanded = sum(1 for t in batch["input_ids"][0] if t == ours.image_token_id)
        counts.add(expanded)
        assert image_token_count(ours, width, height) == expanded
    assert len(counts) > 2  # tiled: the count follows the image's shape


def test_qwen2_vl_counts_match_the_image_grid(tiny_vlm: Callable[[str], Path]) -> None:
    proc = load_vision_processor(tiny_vlm("qwen2_vl"))
    counts = []
    for width, height in SIZES:
        grid = proc.image_processor(images=[sample_image(width, height)], return_tensors="pt")["image_grid_thw"][0]
        counts.append(image_token_count(proc, width, height))
        assert counts[-1] == int(grid.prod()) // 4
    assert len(set(counts)) == len(counts)  # dynamic resolution: every size differs here


def test_bad_size_and_unknown_model(tiny_vlm: Callable[[str], Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="positive"):
        image_token_count(load_vision_processor(tiny_vlm("llava")), 0, 5)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="not a supported vision-language model"):
        load_vision_processor(tmp_path)


def test_llava_folder_without_processor_settings(tiny_vlm: Callable[[str], Path], tmp_path: Path) -> None:
    """An older LLaVA folder whose processor_config.json lacks patch size, CLS count and strategy:
    they come from the model's config (CLIP tower: a CLS token the default strategy drops)."""
    import json
    import shutil

    folder = shutil.copytree(tiny_vlm("llava"), tmp_path / "llava-old")
    settings = json.loads((folder / "processor_config.json").read_text())
    for key in ("patch_size", "num_additional_image_tokens", "vision_feature_select_strategy"):
        settings.pop(key)
    (folder / "processor_config.json").write_text(json.dumps(settings))
    assert image_token_count(load_vision_processor(folder), 40, 24) == 16  # (32 / 8) ** 2


@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_vl"])
def test_placeholder_tokens_predict_the_expanded_prompt(family: str, tiny_vlm: Callable[[str], Path]) -> None:
    from batchgen.engine.vision.images import request_images
    from batchgen.engine.vision.prompts import expand_images
    from batchgen.engine.vision.token_counts import placeholder_tokens

    processor = load_vision_processor(tiny_vlm(family))
    ids = processor.tokenizer(f"w5 {processor.placeholder} w6 {processor.placeholder}")["input_ids"]
    images = request_images([sample_image(40, 24, 1), sample_image(64, 64, 2)], "test")
    expanded = expand_images(processor, list(ids), images, "test")
    predicted = len(ids) - 2 + sum(placeholder_tokens(processor, i.width, i.height) for i in images)
    assert len(expanded.token_ids) == predicted
