"""Tiny PEFT LoRA adapters for the tiny models (testkit/tiny_models): built with peft itself.

Why peft and not hand-written files: the folders must be exactly what users bring (peft's key
names, its adapter_config.json), and the parity reference merges them with peft. peft starts
lora_B at zero (the adapter changes nothing until trained), so B is drawn here: non-zero, large
enough that greedy tokens differ from the base model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_tiny_adapter(
    base: Path,
    path: Path,
    *,
    r: int = 4,
    alpha: int = 8,
    target_modules: Any = ("q_proj", "v_proj"),
    seed: int = 0,
    scale: float = 0.5,
    **options: Any,
) -> Path:
    """A LoRA adapter of the model in folder `base`, saved to `path` (adapter_config.json and
    adapter_model.safetensors): rank `r`, `alpha`, `target_modules` and any other LoraConfig
    `options` (rank_pattern, use_rslora, layers_to_transform, ...); A and B drawn with `seed`,
    B ~ N(0, scale^2)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(target_modules) if not isinstance(target_modules, str) else target_modules,
        **options,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, scale)
            elif "lora_A" in name:
                param.normal_(0.0, 1.0 / param.shape[1] ** 0.5)
    peft_model.save_pretrained(str(path))
    return path


def merged_model(base: Path, adapter: Path | None) -> Any:
    """transformers' model of `base` with `adapter` merged into its weights by peft (None: the base), float32, eval."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()
