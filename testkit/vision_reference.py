"""transformers' own greedy `generate` on the same VLM folder and the same images: the reference
every vision parity test compares the engine with (float32, token for token). In testkit (not the
tests) so that the prepared GPU check (benchmarks/gpu_check_vision.py) runs it too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from batchgen import LLM


def reference_tokens(
    llm: LLM, folder: Path, prompts: list[dict[str, Any]], max_tokens: int, device: str = "cpu"
) -> list[list[int]]:
    """Greedy tokens of transformers' generate for each {"prompt", "multi_modal_data"} prompt,
    one at a time, with the processor's pixels and the expanded prompt (Qwen2-VL: the token types
    its M-RoPE reads)."""
    from transformers import AutoModelForImageTextToText

    vision = llm._vision
    assert vision is not None
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]  # transformers types .to() badly
    out = []
    for p in prompts:
        images = p["multi_modal_data"]["image"]
        images = images if isinstance(images, list) else [images]
        ids = llm.tokenizer(p["prompt"])["input_ids"]
        expanded, _ = vision.prompt(ids, p["multi_modal_data"], "reference")
        pixels = vision.processor.image_processor(images=[i.convert("RGB") for i in images], return_tensors="pt")
        keep = ("pixel_values", "image_grid_thw", "image_sizes")
        kwargs: dict[str, Any] = {k: v.to(device) for k, v in pixels.items() if k in keep}
        types = torch.tensor([[int(t == vision.processor.image_token_id) for t in expanded]])
        if vision.processor.family == "qwen2_vl":
            kwargs["mm_token_type_ids"] = types.to(device)
        if vision.processor.family == "gemma3":  # its image tokens attend both ways
            kwargs["token_type_ids"] = types.to(device)
        with torch.no_grad():
            generated = model.generate(
                input_ids=torch.tensor([expanded], device=device),
                attention_mask=torch.ones(1, len(expanded), dtype=torch.long, device=device),
                max_new_tokens=max_tokens,
                do_sample=False,
                **kwargs,
            )
        out.append(generated[0, len(expanded) :].tolist())
    return out
