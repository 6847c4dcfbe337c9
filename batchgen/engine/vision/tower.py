"""The checkpoint's own vision tower and projector, run on a step's new images: decoded pixels
through the family's image processor, one batched tower call, one embedding matrix per image.

Why per family: the towers take different inputs (LLaVA: one fixed-size crop per image, a chosen
hidden layer, CLS dropped; Qwen2-VL: a flat list of patches with each image's grid), but each is
the model's own `get_image_features`, so the embeddings are exactly transformers'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from batchgen.engine.vision.processor import VisionProcessor


class VisionTower:
    """`encode(images)` -> one [tokens, hidden] tensor per image, on the model's device."""

    def __init__(self, vlm: Any, processor: VisionProcessor, device: torch.device, dtype: torch.dtype) -> None:
        self.model = vlm.model  # the VLM's base (LlavaModel, Qwen2VLModel): tower, projector, LM
        self.config = vlm.config
        self.processor = processor
        self.device = device
        self.dtype = dtype

    def pixel_inputs(self, images: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Decoded RGB images -> the tower's host inputs (the family's image processor)."""
        batch = self.processor.image_processor(images=list(images), return_tensors="pt")
        keep = {"qwen2_vl": ("pixel_values", "image_grid_thw"), "llava_next": ("pixel_values", "image_sizes")}.get(
            self.processor.family, ("pixel_values",)
        )
        return {k: batch[k] for k in keep}

    @torch.inference_mode()
    def encode(self, inputs: dict[str, torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
        """The tower's inputs (on the device) -> each image's embeddings [tokens, hidden]
        (`counts`: each image's tokens, as its prompt was expanded)."""
        pixels = inputs["pixel_values"].to(self.dtype)
        if self.processor.family == "qwen2_vl":
            out = self.model.get_image_features(pixel_values=pixels, image_grid_thw=inputs["image_grid_thw"])
        elif self.processor.family == "gemma3":  # SigLIP, then the projector's pooling to a fixed count
            out = self.model.get_image_features(pixel_values=pixels)
        elif self.processor.family == "llava_next":  # an image's tiles, unpadded and packed with newline rows
            out = self.model.get_image_features(
                pixel_values=pixels,
                image_sizes=inputs["image_sizes"],
                vision_feature_layer=self.config.vision_feature_layer,
                vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            )
        else:
            out = self.model.get_image_features(
                pixel_values=pixels,
                vision_feature_layer=self.config.vision_feature_layer,
                vision_feature_select_strategy=self.config.vision_feature_select_strategy,
            )
        embeds = list(out.pooler_output)
        if [e.shape[0] for e in embeds] != counts:  # the processor's arithmetic and the tower disagree
            raise RuntimeError(f"image tokens {[e.shape[0] for e in embeds]} != the prompts' {counts}")
        return embeds
