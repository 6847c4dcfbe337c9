"""Images with a LoRA adapter on the VLM's language model: greedy tokens equal transformers'
generate on the VLM with peft's merged adapter (float32), rows of the adapter and of the base
model in one batch; the prefix cache never serves an image's blocks across adapters; an adapter
that targets the vision tower is refused by name."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchgen import LLM, LoRARequest, SamplingParams
from testkit.tiny_vision import sample_image
from testkit.vision_reference import reference_tokens

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def adapter_and_merged(model: Path, tmp: Path, targets: str) -> tuple[Path, Path]:
    """A peft adapter of the VLM (B drawn non-zero) and the VLM with it merged, saved with the processor files."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    vlm = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(vlm, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
            elif "lora_A" in name:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
    peft_model.save_pretrained(str(tmp / "adapter"))
    base = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(tmp / "adapter")).merge_and_unload()
    shutil.copytree(model, tmp / "merged")
    merged.save_pretrained(str(tmp / "merged"))
    return tmp / "adapter", tmp / "merged"


def prompts(placeholder: str) -> list[dict[str, Any]]:
    a, b = sample_image(40, 24, 1), sample_image(64, 64, 2)
    return [
        {"prompt": f"w5 {placeholder} w7 w8", "multi_modal_data": {"image": a}},
        {"prompt": f"w5 {placeholder} w7 w8", "multi_modal_data": {"image": a}},  # the same under the base model
        {"prompt": f"w9 {placeholder} w3", "multi_modal_data": {"image": b}},
    ]


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3"])
def test_an_adapter_on_the_language_model_equals_peft_merged(
    family: str, tiny_vlm: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tiny_vlm(family)
    adapter, merged = adapter_and_merged(folder, tmp_path, r".*language_model.*\.(q_proj|v_proj|down_proj)")
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, enable_lora=True, max_lora_rank=8)
    assert llm._vision is not None
    given = prompts(llm._vision.processor.placeholder)
    lora = LoRARequest("captions", 1, str(adapter))
    outs = llm.generate(given, GREEDY, lora_request=[lora, None, lora])
    assert all(o.error is None for o in outs), [o.error for o in outs]
    tokens = [o.outputs[0].token_ids for o in outs]
    with_adapter = reference_tokens(llm, merged, [given[0], given[2]], GREEDY.max_tokens or 0)
    base = reference_tokens(llm, folder, [given[1]], GREEDY.max_tokens or 0)
    assert [tokens[0], tokens[2]] == with_adapter
    assert [tokens[1]] == base and tokens[0] != tokens[1]  # the adapter changes the answer
    # again: each prompt's blocks come from the cache of its own adapter (the image's included), never the other's
    again = llm.generate([given[0], given[0]], GREEDY, lora_request=[None, lora])
    assert [o.outputs[0].token_ids for o in again] == [tokens[1], tokens[0]]
    assert all(o.num_cached_tokens > 0 for o in again)


def test_an_adapter_of_the_vision_tower_is_refused_by_name(tiny_vlm: Callable[[str], Path], tmp_path: Path) -> None:
    adapter, _ = adapter_and_merged(tiny_vlm("llava"), tmp_path, r".*vision_tower.*\.q_proj")
    llm = LLM(str(tiny_vlm("llava")), device="cpu", dtype="float32", block_size=4, enable_lora=True)
    prompt = {"prompt": "w5 <image>", "multi_modal_data": {"image": sample_image(8, 8)}}
    (out,) = llm.generate([prompt], GREEDY, lora_request=LoRARequest("tower", 1, str(adapter)))
    assert out.error is not None and "is not in the language model" in out.error
