"""A vision-language checkpoint as the engine runs it: its language model and LM head as a
causal LM whose input embeddings take the step's image embeddings (and, for M-RoPE, its
three-axis positions), and its tower apart (vision/tower).

Why a wrapper and not the VLM's own forward: the VLM's forward finds image tokens by comparing
ids and runs the tower itself, on whole prompts; the engine runs chunks of many sequences in one
packed row, with the tower's embeddings kept across chunks (vision/encoder). The wrapper holds
the very same modules (no copy), and the model runner calls it exactly as it calls a text model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from batchgen.engine.attention.interface import ATTN_IMPLEMENTATION
from batchgen.engine.runner.model_limits import refuse
from batchgen.engine.vision.processor import vision_family

logger = logging.getLogger(__name__)


@dataclass
class SpliceStep:
    """What one forward adds to its token embeddings: `rows` [M] of the packed row take `embeds`
    [M, hidden]; `positions` [3, 1, T] replace the 1-D positions (M-RoPE), or None."""

    rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    positions: torch.Tensor | None = None


@dataclass
class _Output:
    logits: torch.Tensor


class VisionLanguageLM(torch.nn.Module):
    """The VLM's language model and LM head, called like a causal LM by the model runner."""

    lora_prefix = "model."  # its modules' names in the VLM (and its adapters): model.language_model.*

    def __init__(self, vlm: Any) -> None:
        super().__init__()
        self.language_model = vlm.model.language_model
        self.lm_head = vlm.lm_head
        self.config = vlm.config
        self.generation_config = vlm.generation_config
        self.step: SpliceStep | None = None  # set by the runner's vision state around one forward
        # M-RoPE (Qwen2-VL, Qwen2.5-VL): positions are [3, T], in CUDA-graph buffers too (cuda/graphs)
        self.rope_axes = 3 if vision_family(self.config.model_type) == "qwen2_vl" else 0

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.language_model.get_input_embeddings()

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    @property
    def base_model(self) -> torch.nn.Module:
        return self.language_model

    def step_embeddings(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's input embeddings and positions, run eager before the (maybe compiled) forward
        (runner/compiled_forward): input_ids [T], positions [T] (M-RoPE: [3, T]) -> embeddings
        [T, hidden] with the step's image embeddings at their rows, and the step's M-RoPE positions
        [3, T] where it has them, else `positions`.

        The step serves one forward and is then dropped: a CUDA graph captured later (its decode
        buffers as inputs) must never bake a past step's splice in."""
        embeds = self.get_input_embeddings()(input_ids)  # [T, hidden]
        step, self.step = self.step, None
        if step is not None and step.rows is not None and step.embeds is not None:
            embeds.index_copy_(0, step.rows, step.embeds.to(embeds.dtype))
        if step is not None and step.positions is not None:
            positions = step.positions[:, 0]  # [3, T]
        return embeds, positions

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: torch.Tensor,
        use_cache: bool = False,
    ) -> _Output:
        """inputs_embeds [1, T, hidden] (step_embeddings), position_ids [1, T] or [3, 1, T],
        logits_to_keep [K] -> logits [1, K, vocab]."""
        hidden = self.language_model(inputs_embeds=inputs_embeds, position_ids=position_ids, use_cache=False)
        return _Output(self.lm_head(hidden.last_hidden_state[:, logits_to_keep]))


def is_vision_model(path: str) -> bool:
    """Whether the checkpoint at `path` is a vision-language model batchgen runs."""
    config = AutoConfig.from_pretrained(path)
    return vision_family(config.model_type) is not None


def load_vlm(path: str, device: torch.device, dtype: torch.dtype) -> Any:
    """The whole VLM: its language model under batchgen's attention, its tower under sdpa."""
    config = AutoConfig.from_pretrained(path)
    if vision_family(config.model_type) is None:
        raise refuse(config, "this vision-language architecture")
    attn = {"text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa", "": "sdpa"}
    vlm = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    vlm.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() for its own models badly
    logger.info("loaded %s (%s) on %s as %s", path, type(vlm).__name__, device, dtype)
    return vlm
