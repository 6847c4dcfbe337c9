"""Greedy tokens of tiny random LLaVA, LLaVA-NeXT, Qwen2-VL and Gemma 3 on the engine equal transformers' generate
(float32): several images of different sizes in one batch, a repeated image served from the
prefix cache, prefill chunks cut through an image's tokens, and preemption."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchgen import LLM, SamplingParams
from testkit.tiny_vision import image_prompts
from testkit.vision_reference import reference_tokens

FAMILIES = ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3"]
MAX_TOKENS = 6


def run(folder: Path, **settings: Any) -> tuple[LLM, list[list[int]], list[int]]:
    """Eager (compiled: test_compiled.py, the CPU's default; each LLM here would compile again)."""
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, **{"compile": False, **settings})
    assert llm._vision is not None
    prompts = image_prompts(llm._vision.processor.placeholder)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return llm, [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.fixture(scope="module")
def expected(tiny_vlm: Callable[[str], Path]) -> dict[str, list[list[int]]]:
    got = {}
    for family in FAMILIES:
        llm = LLM(str(tiny_vlm(family)), device="cpu", dtype="float32", block_size=4)
        assert llm._vision is not None
        got[family] = reference_tokens(
            llm, tiny_vlm(family), image_prompts(llm._vision.processor.placeholder), MAX_TOKENS
        )
    return got


@pytest.mark.parametrize("family", FAMILIES)
def test_one_batch_matches_transformers(family: str, tiny_vlm: Callable[[str], Path], expected: Any) -> None:
    _, tokens, _ = run(tiny_vlm(family))
    assert tokens == expected[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_repeated_image_is_a_prefix_hit(family: str, tiny_vlm: Callable[[str], Path], expected: Any) -> None:
    """One sequence at a time: prompt 2 repeats prompt 0's text and image, so its blocks up to the
    text after the image come from the cache; a different image never shares a block."""
    _, tokens, cached = run(tiny_vlm(family), max_num_seqs=1)
    assert tokens == expected[family]
    assert cached[2] >= 8  # the leading text and the image's tokens (two blocks at least)
    assert cached[0] == cached[1] == cached[3] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_chunks_cut_through_images(family: str, tiny_vlm: Callable[[str], Path], expected: Any) -> None:
    """7 tokens a step: every image of >= 15 tokens is split over three chunks or more (Gemma 3's,
    4 tokens attending both ways, never: its chunks end before it instead); the encoder cache runs
    the tower at most once per image occurrence (6), never once per chunk (>= 18)."""
    llm, tokens, _ = run(tiny_vlm(family), max_num_batched_tokens=7, max_num_seqs=2, enable_prefix_caching=False)
    assert tokens == expected[family]
    vision = llm.engine.runner.vision  # type: ignore[attr-defined]
    assert vision.tower_runs <= 6
    assert not vision.cache and not vision.claims  # everything freed when done


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption(family: str, tiny_vlm: Callable[[str], Path], expected: Any) -> None:
    """A pool too small for all five: decodes preempt sequences, whose recomputation runs their
    images (and Qwen2-VL's positions, the decode offset included) again."""
    # each prompt fits alone, not all five
    blocks = {"llava": 24, "llava_next": 50, "qwen2_vl": 28, "qwen2_5_vl": 28, "gemma3": 10}[family]
    llm, tokens, _ = run(tiny_vlm(family), num_kv_blocks=blocks, max_num_seqs=5)
    assert tokens == expected[family]
    assert llm.stats["preemptions"] > 0
