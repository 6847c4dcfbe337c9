"""vLLM's `LLM`: the engine's LLM constructed from vLLM's keywords, read back as vLLM clients read it.

Why here and not in the engine: vLLM's constructor takes every engine argument of its release
(engine_table) and clients pass them with neutral values; mapping and refusing them (keywords,
arg_rules), `llm.llm_engine.model_config` (views), `generation_config="auto"`, `LLM.chat`'s
template options and `embed` / `classify` / `score` in vLLM's shapes (pooling) mirror vLLM's
surface; they are not the engine. `batchgen.LLM` and, after install(), `vllm.LLM` are this class;
batchgen.engine.llm.LLM takes an EngineConfig.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, cast

import torch

from batchgen.engine.api.config import engine_config
from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.api.prompts import PromptInput
from batchgen.engine.llm import LLM as EngineLLM
from batchgen.engine.vision.chat import split_images
from batchgen.vllm_compat.arg_rules import generation_defaults, generation_mode, task_of
from batchgen.vllm_compat.keywords import adapt_vllm_keywords, render_options, vllm_dtype
from batchgen.vllm_compat.pooling import PoolingMethods
from batchgen.vllm_compat.views import LLMEngineView, ModelConfig

__all__ = ["LLM"]


class LLM(EngineLLM, PoolingMethods):
    """Offline batch generation with a paged KV cache, prefix caching and continuous batching."""

    def __init__(
        self,
        model: str,
        *,
        tokenizer: Any = None,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int | None = None,
        task: str = "auto",
        pooler_config: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        """`settings` are EngineConfig's fields (block_size, max_num_seqs, ...) and vLLM's constructor
        keywords (batchgen/vllm_compat/keywords.py: neutral values accepted, others refused);
        an unknown name is a TypeError and a bad value a ValueError, both naming the setting.
        The other arguments are batchgen.engine.llm.LLM's."""
        settings = dict(settings)
        task, self._generation_config = task_of(task, settings), generation_mode(settings)  # vLLM's runner, ...
        config = engine_config(**adapt_vllm_keywords(settings))
        super().__init__(
            model,
            config,
            tokenizer=tokenizer,
            device=device,
            dtype=vllm_dtype(dtype),
            seed=seed,
            task=task,
            pooler_config=pooler_config,
            image_limit=(settings.get("limit_mm_per_prompt") or {}).get("image"),
            mm_processor_kwargs=settings.get("mm_processor_kwargs"),
        )
        tokenizer_name = str(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else model
        model_config = ModelConfig(model, tokenizer_name, self.max_model_len, self.dtype, seed, self.hf_config)
        self.llm_engine = LLMEngineView(model_config, self.tokenizer)  # what vLLM clients read (context length)

    def get_tokenizer(self, lora_request: object = None) -> Any:
        """The tokenizer prompts are encoded with (vLLM's `LLM.get_tokenizer`); an adapter's too
        (adapters that add tokens are refused: their embeddings would be targets)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate(sampling_params=None) uses: SamplingParams(), with generation_config="auto"
        the sampling values of the folder's generation_config.json on top (as vLLM does)."""
        if self._generation_config == "auto":
            return SamplingParams(**generation_defaults(self._model_path))
        return SamplingParams()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content}) or a list of them,
        rendered with the tokenizer's chat template or `chat_template` (as vLLM's `LLM.chat`):
        `continue_final_message` continues the last message (with add_generation_prompt=False),
        `tools` and `chat_template_kwargs` (e.g. {"enable_thinking": False}) go to the template."""
        conversations = cast(
            "list[list[dict[str, Any]]]", [messages] if messages and isinstance(messages[0], dict) else messages
        )
        options = render_options(
            chat_template, add_generation_prompt, continue_final_message, tools, chat_template_kwargs
        )
        prompts: list[PromptInput] = []
        for c, conversation in enumerate(conversations):
            images: list[Any] = []
            if self._vision is not None:  # image content parts: their images, rendered as placeholders
                conversation, images = split_images(conversation, f"conversation {c}")
                options.setdefault("chat_template", self._vision.processor.chat_template)
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, **options)
            # why no special tokens: a rendered template already holds them (BOS etc.)
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            prompt: dict[str, Any] = {"prompt_token_ids": ids, "prompt": text}
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request, on_output=on_output)
