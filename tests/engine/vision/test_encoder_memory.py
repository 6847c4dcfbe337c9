"""The image path's memory bounds: the encoder cache never holds more than encoder_cache_tokens
(evicting embeddings a later chunk still needs, which are recomputed then, token-exact with
transformers), and a step never holds more decoded pixels than max_decoded_pixels (one image
always runs, whatever its size)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchgen import LLM, SamplingParams
from batchgen.engine.api.params import SettingError
from testkit.tiny_vision import sample_image
from testkit.vision_reference import reference_tokens

GREEDY = SamplingParams(max_tokens=5, temperature=0)
LARGEST = {"llava": 16, "qwen2_vl": 64}  # tokens of the largest image below


def prompts(placeholder: str) -> list[dict[str, Any]]:
    """Prompt 1 needs image a (computed for prompt 0 in the first step) after image b: a one-image
    cache evicts a for b, and prompt 1 runs a's tower again when its chunk reaches it."""
    a, b, c = sample_image(40, 24, 1), sample_image(64, 64, 2), sample_image(20, 50, 3)
    words = " ".join(f"w{5 + i % 9}" for i in range(30))
    return [
        {"prompt": f"{placeholder} w7 w8", "multi_modal_data": {"image": a}},
        {"prompt": f"{words} {placeholder} w3 {placeholder} w4", "multi_modal_data": {"image": [b, a]}},
        {"prompt": f"{placeholder} w11", "multi_modal_data": {"image": [c]}},
        {"prompt": f"w12 w13 {placeholder}", "multi_modal_data": {"image": b}},
    ]


def run(folder: Path, cap: int | None, blocks: int | None) -> tuple[LLM, list[dict[str, Any]], list[list[int]]]:
    llm = LLM(
        str(folder),
        device="cpu",
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        enable_prefix_caching=False,
        encoder_cache_tokens=cap,
        num_kv_blocks=blocks,
    )
    assert llm._vision is not None
    given = prompts(llm._vision.processor.placeholder)
    outs = llm.generate(given, GREEDY)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return llm, given, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
@pytest.mark.parametrize("preempt", [False, True])
def test_tiny_cache_evicts_and_recomputes_exactly(family: str, preempt: bool, tiny_vlm: Callable[[str], Path]) -> None:
    folder = tiny_vlm(family)
    cap = LARGEST[family]
    blocks = {"llava": 22, "qwen2_vl": 36}[family] if preempt else None  # each prompt fits alone, not all
    llm, given, tokens = run(folder, cap, blocks)
    assert tokens == reference_tokens(llm, folder, given, GREEDY.max_tokens or 0)
    vision = llm.engine.runner.vision  # type: ignore[attr-defined]
    assert vision.cache.peak <= cap  # never above the cap
    assert vision.cache.evicted > 0  # embeddings still needed were evicted ...
    roomy, _, roomy_tokens = run(folder, None, blocks)
    assert roomy_tokens == tokens
    # ... and recomputed when needed again (a missing entry would fail the gather)
    assert vision.tower_runs >= roomy.engine.runner.vision.tower_runs  # type: ignore[attr-defined]
    assert len(vision.cache) == 0 and vision.cache.used == 0
    if preempt:
        assert llm.stats["preemptions"] > 0


def test_cache_cap_refuses_a_larger_image_by_name(tiny_vlm: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_vlm("qwen2_vl")), device="cpu", dtype="float32", block_size=4, encoder_cache_tokens=20)
    image = sample_image(64, 64, 2)  # 64 tokens: that request fails alone, naming the setting
    small = sample_image(20, 50, 3)  # 12 tokens
    prompt = "w5 <|vision_start|><|image_pad|><|vision_end|>"
    outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": im}} for im in (image, small)], GREEDY)
    assert outs[0].error is not None
    assert "an image of 64 tokens does not fit the encoder cache (encoder_cache_tokens is 20)" in outs[0].error
    assert outs[1].error is None
    with pytest.raises(SettingError, match="encoder_cache_tokens"):
        LLM(str(tiny_vlm("qwen2_vl")), device="cpu", encoder_cache_tokens=0)
    with pytest.raises(SettingError, match="max_decoded_pixels"):
        LLM(str(tiny_vlm("qwen2_vl")), device="cpu", max_decoded_pixels=-5)


def photos(tmp_path: Path) -> list[Any]:
    """Real image files (PNG and JPEG), opened lazily as a user would: 12 of 60,000 to 307,200 pixels."""
    from PIL import Image

    out = []
    for i, (w, h) in enumerate([(300, 200), (640, 480), (400, 300), (320, 240)] * 3):
        path = tmp_path / f"p{i}.{'png' if i % 2 else 'jpg'}"
        sample_image(w, h, i).save(path)
        out.append(Image.open(path))
    return out


def test_decoded_pixels_stay_within_the_budget(tiny_vlm: Callable[[str], Path], tmp_path: Path) -> None:
    images = photos(tmp_path)
    given = [{"prompt": f"w{5 + i} <image> w7", "multi_modal_data": {"image": im}} for i, im in enumerate(images)]
    runs = {}
    for budget in (None, 400_000, 1_000):  # 1,000: below every image; one a step still runs
        llm = LLM(str(tiny_vlm("llava")), device="cpu", dtype="float32", block_size=4, max_decoded_pixels=budget)
        outs = llm.generate(given, GREEDY)
        assert all(o.error is None for o in outs)
        runs[budget] = ([o.outputs[0].token_ids for o in outs], llm.engine.runner.vision.peak_decoded_pixels)  # type: ignore[attr-defined]
    assert runs[None][1] > 1_000_000  # the default budget (32 M) lets a step decode many at once (1.7 M pixels here)
    assert 307_200 <= runs[400_000][1] <= 400_000
    assert runs[1_000][1] == 307_200  # the largest image, alone in its step
    assert runs[None][0] == runs[400_000][0] == runs[1_000][0]
