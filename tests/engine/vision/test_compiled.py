"""A vision-language model's language model runs through the engine's compiled forward, as a text
model's does (runner/compiled_forward): greedy tokens equal transformers' generate (float32) with
compile on, prefill chunks cutting through images, and the steps with images and the decode
steps without any share the graph (the splice runs eager before it, never inside as a constant)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from batchgen import LLM, SamplingParams
from testkit.tiny_vision import image_prompts
from testkit.vision_reference import reference_tokens
from tests.engine.vision.test_parity import MAX_TOKENS


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_compiled_greedy_matches_transformers(family: str, tiny_vlm: Callable[[str], Path]) -> None:
    folder = tiny_vlm(family)
    settings = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=7, max_num_seqs=3)
    llm = LLM(str(folder), compile=True, **settings)  # type: ignore[arg-type]
    assert llm._vision is not None and llm.engine.runner.forward.compile
    prompts = image_prompts(llm._vision.processor.placeholder)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(llm, folder, prompts, MAX_TOKENS)
    forward = llm.engine.runner.forward
    assert forward.compile, "the compiled forward fell back to eager"
    # one graph for 7-token steps with image rows, mixed steps and decode-only steps alike
    assert forward.stats.graphs == 1, forward.stats.shapes
    assert llm.engine.runner.vision.tower_runs > 0  # type: ignore[attr-defined]
