"""The runner's M-RoPE positions (vision/encoder: one packed row's [3, T], built in whole-row tensor
ops from each request's precomputed table) equal transformers' own get_rope_index on Qwen2-VL and
Qwen2.5-VL: several images of different sizes per request, prefill chunks cut through images,
chunks packed out of request order, decode rows (index + the request's delta) and padding."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.core.scheduler_output import BatchUpdate, NewSequence, ScheduledChunk
from testkit.tiny_vision import sample_image


def requests(placeholder: str) -> list[dict[str, Any]]:
    """Three prompts: two images of other sizes between text, one image first, a text-only one."""
    a, b, c = sample_image(40, 24, 1), sample_image(64, 64, 2), sample_image(20, 50, 3)
    return [
        {"prompt": f"w9 {placeholder} w3 w5 {placeholder} w4", "multi_modal_data": {"image": [b, c]}},
        {"prompt": f"{placeholder} w11 w12", "multi_modal_data": {"image": a}},
        {"prompt": "w5 w6 w7 w8"},
    ]


def reference(model: Any, llm: LLM, prompt: dict[str, Any], ids: list[int], decoded: int) -> torch.Tensor:
    """transformers' positions for the prompt then `decoded` generated tokens -> [3, len(ids) + decoded]
    (a generated token: its index + the rope delta, as its generate advances them)."""
    vision = llm._vision
    assert vision is not None
    if "multi_modal_data" not in prompt:  # text only: its model infers 1-D positions
        return torch.arange(len(ids) + decoded).expand(3, -1)
    images = prompt["multi_modal_data"]["image"]
    images = images if isinstance(images, list) else [images]
    grid = vision.processor.image_processor(images=[i.convert("RGB") for i in images], return_tensors="pt")
    input_ids = torch.tensor([ids])
    types = (input_ids == vision.processor.image_token_id).int()
    positions, delta = model.model.get_rope_index(input_ids, types, image_grid_thw=grid["image_grid_thw"])
    generated = torch.arange(len(ids), len(ids) + decoded) + int(delta[0, 0])
    return torch.cat([positions[:, 0], generated.expand(3, -1)], dim=1)  # [3, L + decoded]


def chunk(seq_id: int, start: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(seq_id, start, (0,) * num_tokens, (), False, num_tokens == 1)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_positions_equal_get_rope_index(family: str, tiny_vlm: Callable[[str], Path]) -> None:
    from transformers import AutoModelForImageTextToText

    llm = LLM(str(tiny_vlm(family)), device="cpu", dtype="float32", compile=False)
    vision = llm._vision
    assert vision is not None
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm(family), dtype=torch.float32).eval()
    state = vision.inputs()
    prompts = requests(vision.processor.placeholder)
    new, want = [], []
    for seq_id, prompt in enumerate(prompts):
        ids, extras = vision.prompt(llm.tokenizer(prompt["prompt"])["input_ids"], prompt.get("multi_modal_data"), "t")
        new.append(NewSequence(seq_id, tuple(ids), SamplingParams(), extras))
        want.append(reference(model, llm, prompt, ids, decoded=3))
    state.apply(BatchUpdate(new=tuple(new)))
    lengths = [len(n.prompt_token_ids) for n in new]
    (s0, n0), (s1, n1) = new[0].extras.image_positions
    assert n0 != n1 and max(n0, n1) > 4  # images of different sizes, each cut below

    def check(pieces: list[tuple[int, int, int]], padding: int) -> None:
        """Chunks (seq, start, count), packed in reverse request order, then `padding` rows."""
        ends, end = [0] * len(pieces), 0
        for i in reversed(range(len(pieces))):
            end += pieces[i][2]
            ends[i] = end
        got = state._positions([chunk(*p) for p in pieces], ends, end + padding)  # [3, T]
        for (seq_id, start, count), stop in zip(pieces, ends):
            assert torch.equal(got[:, stop - count : stop], want[seq_id][:, start : start + count]), (seq_id, start)
        assert not got[:, end:].any()

    # prefill in chunks cut through the first request's two images and the second's one
    cut0, cut1 = [0, s0 + n0 // 2, s1 + n1 // 3, lengths[0]], [0, 3, lengths[1]]
    for k in range(3):
        pieces = [(0, cut0[k], cut0[k + 1] - cut0[k])]
        if k < 2:
            pieces.append((1, cut1[k], cut1[k + 1] - cut1[k]))
        if k == 0:
            pieces.append((2, 0, lengths[2]))
        check(pieces, padding=5)
    # a prefill chunk that ends on the prompt's last token, then decode rows beside one another
    check([(1, lengths[1] - 2, 2), (0, lengths[0], 1), (2, lengths[2] + 1, 1)], padding=0)
    for j in range(3):
        check([(seq_id, lengths[seq_id] + j, 1) for seq_id in range(3)], padding=2)
    decode = state.decode_positions([chunk(seq_id, lengths[seq_id] + 2, 1) for seq_id in range(3)])
    assert decode is not None
    assert torch.equal(decode, torch.stack([want[s][:, lengths[s] + 2] for s in range(3)], dim=1))  # [3, 3]
