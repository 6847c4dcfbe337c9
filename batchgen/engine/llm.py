"""LLM: the engine's public API (vLLM names): build everything from a local model folder, generate."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedModel

from batchgen.engine.block_manager import BlockManager
from batchgen.engine.compiled_forward import resolve_compile
from batchgen.engine.config import engine_config
from batchgen.engine.engine import Engine
from batchgen.engine.model_runner import ModelRunner, num_kv_blocks_for
from batchgen.engine.models import kv_spec, load_model, resolve_device, resolve_dtype, resolve_max_model_len
from batchgen.engine.outputs import RequestOutput
from batchgen.engine.params import SamplingParams
from batchgen.engine.sampler import Sampler
from batchgen.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> list[int]:
    """Every id in the generation config's eos_token_id (int or list), plus the tokenizer's eos."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is None:
        configured = getattr(model.config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, (list, tuple)):
        ids.update(int(i) for i in configured)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class LLM:
    """Offline batch generation with a paged KV cache, prefix caching and continuous batching."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: Any = None,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        **settings: Any,
    ) -> None:
        """`settings` are EngineConfig's fields (block_size, max_num_seqs, ...); an unknown name is a
        TypeError and a bad value a ValueError, both naming the setting."""
        config = engine_config(**settings)
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        hf_model = load_model(model, torch_device, torch_dtype)
        self.max_model_len = resolve_max_model_len(hf_model.config, config.max_model_len)
        config.max_model_len = self.max_model_len
        spec = kv_spec(hf_model.config)
        blocks = num_kv_blocks_for(
            spec,
            config.block_size,
            torch_dtype,
            torch_device,
            num_kv_blocks=config.num_kv_blocks,
            budget_bytes=config.kv_cache_memory_bytes,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        runner = ModelRunner(
            hf_model,
            spec,
            config.block_size,
            blocks,
            torch_device,
            torch_dtype,
            config.max_num_seqs,
            self.max_model_len,
            config.decode_kv,
            compile=resolve_compile(config.compile, torch_device),
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        scheduler = Scheduler(config, block_manager, self.max_model_len)
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model)
        eos = eos_token_ids(hf_model, self.tokenizer)
        self.config = config
        vocab_size = int(hf_model.get_input_embeddings().num_embeddings)  # type: ignore[arg-type]
        self.engine = Engine(scheduler, runner, Sampler(eos), self.tokenizer, eos, vocab_size)

    @property
    def stats(self) -> dict[str, int]:
        """Engine counters: steps, requests, errors, prefill/decode/cached/output tokens, preemptions."""
        return self.engine.stats.as_dict()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order.

        `sampling_params`: one for all, one per prompt, or None for the defaults. `on_output` is
        called with each output as it finishes (finish order), e.g. for a progress bar.
        """
        if isinstance(prompts, (str, tuple)) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("prompts must be a list of strings or a list of token-id lists")
        token_ids = [self._encode(i, p) for i, p in enumerate(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(token_ids)
        else:
            params = list(sampling_params)
            if len(params) != len(token_ids):
                raise ValueError(f"got {len(token_ids)} prompts but {len(params)} SamplingParams")
        return self.engine.generate(token_ids, params, on_output=on_output)

    def _encode(self, index: int, prompt: object) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return [int(t) for t in prompt]
        raise TypeError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")
