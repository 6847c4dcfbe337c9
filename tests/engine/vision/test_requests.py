"""Image requests at the API's edge: an image that cannot be decoded fails its request alone
(naming the image), chat() takes OpenAI image content parts, M-RoPE positions are transformers',
and a text-only prompt runs on a VLM."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.vision.images import request_images
from batchgen.engine.vision.processor import load_vision_processor
from batchgen.engine.vision.prompts import expand_images
from testkit.tiny_vision import sample_image

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def png_bytes(width: int, height: int, seed: int) -> bytes:
    buffer = io.BytesIO()
    sample_image(width, height, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def lazy(data: bytes) -> Any:
    from PIL import Image

    return Image.open(io.BytesIO(data))  # header read, pixels not decoded


@pytest.fixture(scope="module")
def llava(tiny_vlm: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_vlm("llava")), device="cpu", dtype="float32", block_size=4)


def test_undecodable_image_fails_its_request_only(llava: LLM) -> None:
    good, broken = png_bytes(40, 24, 1), png_bytes(48, 48, 2)
    truncated = broken[: len(broken) // 2]
    prompts = [
        {"prompt": "w5 <image> w6", "multi_modal_data": {"image": lazy(good)}},
        {"prompt": "w5 <image> w7 <image>", "multi_modal_data": {"image": [lazy(good), lazy(truncated)]}},
        {"prompt": "w8 <image>", "multi_modal_data": {"image": [lazy(truncated)]}},  # same bytes: fails too
        {"prompt": "w9 <image> w6", "multi_modal_data": {"image": lazy(png_bytes(30, 30, 3))}},
    ]
    outs = llava.generate(prompts, GREEDY)
    assert outs[1].error is not None and "image 1: cannot decode" in outs[1].error
    assert outs[2].error is not None and "image 0: cannot decode" in outs[2].error
    alone = llava.generate([prompts[0], prompts[3]], GREEDY)
    assert [outs[0].outputs[0].token_ids, outs[3].outputs[0].token_ids] == [o.outputs[0].token_ids for o in alone]
    assert not llava.engine.requests and not llava.engine.runner.vision.cache  # type: ignore[attr-defined]


def test_chat_takes_image_content_parts(llava: LLM, tmp_path: Path) -> None:
    data = png_bytes(40, 24, 1)
    path = tmp_path / "a.png"
    path.write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    parts = [
        [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w5 w6"}],
        [{"type": "image_url", "image_url": {"url": str(path)}}, {"type": "text", "text": "w5 w6"}],
        [{"type": "image_pil", "image_pil": lazy(data)}, {"type": "text", "text": "w5 w6"}],
    ]
    outs = llava.chat([[{"role": "user", "content": p}] for p in parts], GREEDY)
    assert all(o.error is None for o in outs)
    assert outs[0].prompt is not None and "<image>" in outs[0].prompt
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens[0] == tokens[1] == tokens[2]  # the same image three ways: the same answer


def test_placeholders_must_match_images(llava: LLM) -> None:
    with pytest.raises(ValueError, match=r"prompt 0: the prompt has 2 image placeholder\(s\).*but 1 image"):
        llava.generate({"prompt": "<image> <image>", "multi_modal_data": {"image": sample_image(8, 8)}}, GREEDY)
    with pytest.raises(TypeError, match=r"prompt 0: image 0 must be a PIL\.Image\.Image"):
        llava.generate({"prompt": "<image>", "multi_modal_data": {"image": b"png"}}, GREEDY)


def test_text_only_prompt_on_a_vlm(llava: LLM) -> None:
    out = llava.generate(["w5 w6 w7"], GREEDY)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4


def test_mrope_positions_are_transformers(tiny_vlm: Callable[[str], Path]) -> None:
    from transformers import AutoModelForImageTextToText

    folder = tiny_vlm("qwen2_vl")
    processor = load_vision_processor(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder)
    images = request_images([sample_image(40, 24, 1), sample_image(20, 70, 2)], "test")
    ph = processor.placeholder
    ids = processor.tokenizer(f"w5 {ph} w6 w7 {ph} w8")["input_ids"]
    prompt = expand_images(processor, ids, images, "test")
    grids = processor.image_processor(images=[i.image for i in images], return_tensors="pt")["image_grid_thw"]
    types = torch.tensor([[int(t == processor.image_token_id) for t in prompt.token_ids]])
    theirs, delta = model.model.get_rope_index(torch.tensor([prompt.token_ids]), types, image_grid_thw=grids)
    assert theirs[:, 0].tolist() == [list(axis) for axis in prompt.extras.rotary_positions]
    from batchgen.engine.vision.prompts import rotary_delta

    assert rotary_delta(prompt.extras, len(prompt.token_ids)) == int(delta)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
def test_same_image_twice_in_one_prompt(family: str, tiny_vlm: Callable[[str], Path]) -> None:
    """One content hash at two places in one prompt, in 9-token chunks: both places get its
    embeddings (two claims on one cache entry), and the cache ends empty."""
    from testkit.vision_reference import reference_tokens

    folder = tiny_vlm(family)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=9)
    assert llm._vision is not None
    ph, image = llm._vision.processor.placeholder, sample_image(40, 24, 1)
    prompts = [{"prompt": f"w5 {ph} w6 {ph}", "multi_modal_data": {"image": [image, image]}}]
    out = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.outputs[0].token_ids == reference_tokens(llm, folder, prompts, 5)[0]
    assert not llm.engine.runner.vision.cache  # type: ignore[attr-defined]


def test_limit_mm_per_prompt(tiny_vlm: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_vlm("llava")), device="cpu", dtype="float32", limit_mm_per_prompt={"image": 1})
    image = sample_image(8, 8)
    assert llm.generate({"prompt": "<image>", "multi_modal_data": {"image": image}}, GREEDY)[0].error is None
    with pytest.raises(ValueError, match="prompt 0: 2 images, more than limit_mm_per_prompt's 1"):
        llm.generate({"prompt": "<image> <image>", "multi_modal_data": {"image": [image, image]}}, GREEDY)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        LLM(str(tiny_vlm("llava")), device="cpu", limit_mm_per_prompt={"video": 1})


def test_prefix_cache_tells_images_apart(tiny_vlm: Callable[[str], Path]) -> None:
    """Same text, one sequence at a time: a different image of the same size shares only the
    text blocks before it; the same image bytes share the image's blocks too."""
    llm = LLM(str(tiny_vlm("llava")), device="cpu", dtype="float32", block_size=4, max_num_seqs=1)
    a, b = png_bytes(40, 24, 1), png_bytes(40, 24, 2)
    prompts = [{"prompt": "w5 w6 w7 w8 <image> w9 w10", "multi_modal_data": {"image": lazy(x)}} for x in (a, b, a)]
    cached = [o.num_cached_tokens for o in llm.generate(prompts, GREEDY)]
    assert cached == [0, 4, 20]  # the 4 text tokens; then they and the 16 image tokens


def test_the_callers_images_stay_undecoded(llava: LLM) -> None:
    """A lazily opened image is decoded into a fresh object: the caller's keeps no pixels (a job
    holding a part's prompts never holds the part's decoded images)."""
    image = lazy(png_bytes(40, 24, 4))
    out = llava.generate({"prompt": "w5 <image>", "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert out.error is None
    assert image._im is None  # still only its header read (Pillow keeps decoded pixels in _im)


def test_mm_processor_kwargs_bound_qwen2_vl_images(tiny_vlm: Callable[[str], Path]) -> None:
    """vLLM's mm_processor_kwargs: Qwen2-VL's max_pixels shrinks an image's tokens and its pixels
    alike (the output still equals transformers with the same bound); others are refused."""
    from testkit.vision_reference import reference_tokens

    folder = tiny_vlm("qwen2_vl")
    llm = LLM(str(folder), device="cpu", dtype="float32", mm_processor_kwargs={"max_pixels": 24 * 24, "fps": 1})
    assert llm._vision is not None
    ph, image = llm._vision.processor.placeholder, sample_image(64, 64, 2)
    prompts = [{"prompt": f"w5 {ph} w6", "multi_modal_data": {"image": image}}]
    out = llm.generate(prompts, GREEDY)[0]
    assert out.prompt_token_ids.count(llm._vision.processor.image_token_id) == 9  # 24 x 24 pixels: 3 x 3 tokens
    assert out.outputs[0].token_ids == reference_tokens(llm, folder, prompts, 4)[0]
    with pytest.raises(ValueError, match="only Qwen2-VL's min_pixels and max_pixels"):
        LLM(str(tiny_vlm("llava")), device="cpu", mm_processor_kwargs={"max_pixels": 100})


def test_other_multimodal_models_are_refused_naming_the_supported(tmp_path: Path) -> None:
    import transformers as tf

    from batchgen.engine.runner.models import UnsupportedModelError

    tf.PaliGemmaConfig(text_config={"vocab_size": 64}).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="images run on LLaVA, LLaVA-NeXT, Qwen2-VL"):
        LLM(str(tmp_path), device="cpu")
