"""Gemma 3's image tokens attend to each other both ways: the engine's next-token log-probabilities
after prompts with images equal transformers' forward with the images' token types (which sets
that mask) to float32 precision, with the prompt prefilled whole and in chunks that the scheduler
ends before an image (never inside one). Greedy tokens alone can hide the mask on a tiny model;
the log-probabilities cannot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.core.image_budget import cut_before_image
from batchgen.engine.core.sequence import RequestExtras, Sequence
from testkit.tiny_vision import sample_image

PROMPTS = ["w5 <start_of_image> w7 w8", "w9 w3 w4 w6 w2 w8 <start_of_image> w4 <start_of_image>"]


def transformers_logprobs(llm: LLM, folder: Path, prompt: str, images: list) -> torch.Tensor:
    from transformers import AutoModelForImageTextToText

    vision = llm._vision
    assert vision is not None
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    ids, _ = vision.prompt(llm.tokenizer(prompt)["input_ids"], {"image": images}, "reference")
    pixels = vision.processor.image_processor(images=images, return_tensors="pt")["pixel_values"]
    types = torch.tensor([[int(t == vision.processor.image_token_id) for t in ids]])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=types).logits
    return torch.log_softmax(logits[0, -1].float(), -1)


@pytest.mark.parametrize(("budget", "backend"), [(None, "auto"), (5, "auto"), (None, "triton"), (5, "triton")])
def test_next_token_logprobs_match(budget: int | None, backend: str, tiny_vlm: Callable[[str], Path]) -> None:
    """The torch prefill mask (the cpu backend's prefill path) and the triton kernel's key bounds
    (Triton's interpreter on the CPU; what a CUDA GPU runs by default)."""
    folder = tiny_vlm("gemma3")
    settings = {"max_num_batched_tokens": budget} if budget else {}
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, attention_backend=backend, **settings)
    images = [[sample_image(40, 24, 1)], [sample_image(20, 50, 2), sample_image(64, 64, 3)]]
    prompts = [{"prompt": p, "multi_modal_data": {"image": i}} for p, i in zip(PROMPTS, images)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    for out, prompt, imgs in zip(outs, PROMPTS, images):
        theirs = transformers_logprobs(llm, folder, prompt, imgs)
        ours = out.outputs[0].logprobs[0]  # type: ignore[index]
        for token, entry in ours.items():
            assert entry.logprob == pytest.approx(float(theirs[token]), abs=1e-4)


def test_chunks_end_before_an_image_never_inside() -> None:
    from batchgen.engine.api.params import SamplingParams as Params

    seq = Sequence(0, list(range(20)), Params(max_tokens=1))
    seq.extras = RequestExtras(image_positions=((4, 6), (12, 3)), atomic_images=True)
    assert cut_before_image(seq, 0, 4) == 4  # ends where the image starts
    assert cut_before_image(seq, 0, 7) == 4  # would end inside the first image: cut before it
    assert cut_before_image(seq, 4, 5) == 0  # starts at an image it cannot finish: waits
    assert cut_before_image(seq, 4, 6) == 6
    assert cut_before_image(seq, 10, 4) == 2
    seq.extras = RequestExtras(image_positions=((4, 6),))  # LLaVA-style images may be cut anywhere
    assert cut_before_image(seq, 0, 7) == 7
