"""What an LLM over a vision-language checkpoint builds besides the text engine: the config
check, the language model the runner runs, the tower, and the prompt side (processor, images ->
expanded token ids and extras).

Why a module of its own: llm.py asks three questions (is this a VLM? what does the runner run?
how does a prompt with images become tokens?) and the answers stay in this room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from batchgen.engine.core.sequence import NO_EXTRAS, RequestExtras
from batchgen.engine.runner.model_limits import refuse
from batchgen.engine.vision.encoder import VisionInputs
from batchgen.engine.vision.images import request_images
from batchgen.engine.vision.model import VisionLanguageLM, load_vlm
from batchgen.engine.vision.processor import VisionProcessor, load_vision_processor, vision_family
from batchgen.engine.vision.prompts import expand_images
from batchgen.engine.vision.tower import VisionTower

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}


def is_vision_config(config: PretrainedConfig) -> bool:
    return vision_family(getattr(config, "model_type", "")) is not None


def check_vision_config(config: PretrainedConfig, tensor_parallel_size: int) -> None:
    """Refuse, before any weights are read, what the vision path cannot run exactly."""
    text = config.get_text_config()
    layer_types = set(getattr(text, "layer_types", None) or [])
    if not layer_types <= SUPPORTED_LAYER_TYPES:
        raise refuse(config, f"a vision-language model with layer types {sorted(layer_types - SUPPORTED_LAYER_TYPES)}")
    if getattr(text, "use_sliding_window", False):  # Qwen2-VL's: the window ignores M-RoPE's positions
        raise refuse(config, "a vision-language model with sliding-window attention")
    if tensor_parallel_size > 1:
        raise refuse(config, "tensor parallelism for a vision-language model")


@dataclass
class VisionModel:
    """The pieces an LLM keeps for a VLM."""

    lm: VisionLanguageLM
    tower: VisionTower
    processor: VisionProcessor

    max_chunk: int = 0  # the step's token budget (Gemma 3: an image's tokens are prefilled in one chunk)

    def check_runner(self, runner: Any, max_num_batched_tokens: int) -> None:
        """Gemma 3's images attend both ways: only the attention that takes that mask may run it
        (the triton kernel, and the torch / cpu backends' torch prefill path; not the torch
        backend's varlen (FlashAttention) path on CUDA)."""
        self.max_chunk = max_num_batched_tokens
        takes_mask = runner.backend.name == "triton" or (runner.backend.name in ("torch", "cpu") and not runner.flash)
        if self.processor.family == "gemma3" and not takes_mask:
            raise refuse(
                self.lm.config,
                f"bidirectional image attention on the {runner.backend.name} attention backend's "
                f"{runner.attention.path} path (use 'triton', or 'torch' / 'cpu' off the varlen kernel)",
            )

    def inputs(self, cache_tokens: int | None = None) -> VisionInputs:
        """The runner side's image state over this model; its encoder cache holds `cache_tokens`
        (None: the step's token budget, raised to the largest image, as the scheduler's cap)."""
        cap = cache_tokens if cache_tokens is not None else self.max_chunk
        mrope = self.processor.family == "qwen2_vl"
        return VisionInputs(self.lm, self.tower, mrope, cap, auto_cap=cache_tokens is None)

    def prompt(self, token_ids: list[int], multi_modal_data: Any, where: str) -> tuple[list[int], RequestExtras]:
        """A prompt's token ids (with one placeholder per image) and its multi_modal_data ->
        (expanded token ids, extras with the images)."""
        if not multi_modal_data:  # text only (M-RoPE: its three axes are its index, as the runner makes them)
            return token_ids, NO_EXTRAS
        unknown = sorted(set(multi_modal_data) - {"image"})
        if unknown:
            raise ValueError(f"{where}: multi_modal_data key(s) {unknown} are not supported (supported: image)")
        images = request_images(multi_modal_data.get("image", []), where)
        expanded = expand_images(self.processor, token_ids, images, where)
        extras = expanded.extras
        if extras.atomic_images and self.max_chunk:
            largest = max((count for _, count in extras.image_positions), default=0)
            if largest > self.max_chunk:
                raise ValueError(
                    f"{where}: an image of {largest} tokens must be prefilled in one step, but "
                    f"max_num_batched_tokens is {self.max_chunk}"
                )
        return expanded.token_ids, extras


def apply_processor_kwargs(processor: VisionProcessor, kwargs: dict[str, Any]) -> None:
    """vLLM's mm_processor_kwargs onto the processor; ValueError naming what is not supported."""
    pixels: dict[str, Any] = {k: kwargs[k] for k in ("min_pixels", "max_pixels") if k in kwargs}
    unknown = sorted(set(kwargs) - {"min_pixels", "max_pixels", "fps"})
    if unknown or (pixels and processor.family != "qwen2_vl"):
        raise ValueError(
            f"LLM(mm_processor_kwargs={kwargs!r}): only Qwen2-VL's min_pixels and max_pixels are supported"
        )
    if pixels:
        size: Any = processor.image_processor.size
        low: Any = size["shortest_edge"] if isinstance(size, dict) else size.shortest_edge
        high: Any = size["longest_edge"] if isinstance(size, dict) else size.longest_edge
        bounds = {
            "shortest_edge": int(pixels.get("min_pixels", low)),
            "longest_edge": int(pixels.get("max_pixels", high)),
        }
        processor.image_processor.size = type(size)(**bounds) if not isinstance(size, dict) else bounds


def load_vision_model(
    path: str, device: torch.device, dtype: torch.dtype, mm_processor_kwargs: dict[str, Any] | None = None
) -> VisionModel:
    """The VLM at `path`; `mm_processor_kwargs` (vLLM's): Qwen2-VL's min_pixels / max_pixels
    bound its images' resize (token counts and pixels alike), `fps` (video) is ignored."""
    processor = load_vision_processor(path)
    apply_processor_kwargs(processor, mm_processor_kwargs or {})
    vlm = load_vlm(path, device, dtype)
    return VisionModel(VisionLanguageLM(vlm), VisionTower(vlm, processor, device, dtype), processor)
