"""LLM: the engine's entry: build everything from a local model folder and an EngineConfig, generate.

vLLM's constructor keywords, `llm_engine` and `chat` are batchgen.vllm_compat's `LLM` (what
`batchgen.LLM` is), a subclass of this one: the engine knows EngineConfig only."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from batchgen.engine.api.config import EngineConfig, ResolvedConfig
from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SEED_EXPECTED, SamplingParams, SettingError, is_seed
from batchgen.engine.api.platform import resolve
from batchgen.engine.api.prompts import PromptInput, encode_prompt
from batchgen.engine.attention.path import has_softcap
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.scheduler import Scheduler
from batchgen.engine.core.sequence import NO_EXTRAS
from batchgen.engine.loop.engine import Engine
from batchgen.engine.lora.requests import NOT_ENABLED, LoRAAdapters, per_prompt
from batchgen.engine.lora.setup import install_lora
from batchgen.engine.parallel.group import ShardedRunner, TensorParallelGroup, start_tensor_parallel
from batchgen.engine.platforms import platform_for
from batchgen.engine.pooling.model import TASKS, PoolingModel, resolve_task, runs_on_engine
from batchgen.engine.runner.model_runner import ModelRunner
from batchgen.engine.runner.models import (
    check_config,
    kv_spec,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from batchgen.engine.runner.pool_sizing import kv_pool_blocks
from batchgen.engine.runner.tokenizer import load_tokenizer
from batchgen.engine.sampling.penalties import LogitsFeatures
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.vision.setup import VisionModel, check_vision_config, is_vision_config, load_vision_model

logger = logging.getLogger(__name__)

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> list[int]:
    """Every id in the generation config's eos_token_id (int or list), plus the tokenizer's eos."""
    generation_config = getattr(model, "generation_config", None)
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is None:
        configured = getattr(model.config, "eos_token_id", None)
    ids = {configured} if isinstance(configured, int) else {int(i) for i in configured or ()}
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def make_sampler(
    model: PreTrainedModel, tokenizer: Any, seed: int | None, device: torch.device
) -> tuple[Sampler, list[int], int]:
    """The sampler for `model`'s logits (the runner's), its EOS ids and the model's vocabulary size."""
    eos = eos_token_ids(model, tokenizer)
    vocab_size = int(model.get_input_embeddings().num_embeddings)  # type: ignore[arg-type]
    # why the logits' width: penalties and grammar masks index logits, which may be wider than the embeddings
    head = model.get_output_embeddings()
    width = int(getattr(head, "out_features", 0) or vocab_size)
    features = LogitsFeatures(tokenizer, width, eos)
    return Sampler(eos, seed=seed, fast_greedy=platform_for(device).greedy_ids(), features=features), eos, vocab_size


class LLM:
    """Offline batch generation with a paged KV cache, prefix caching and continuous batching."""

    def __init__(
        self,
        model: str,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any = None,
        device: str = "auto",
        dtype: str | torch.dtype = "auto",
        seed: int | None = None,
        task: str = "auto",
        pooler_config: dict[str, Any] | None = None,
        image_limit: int | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """`config`: the engine settings (None: EngineConfig()). `tokenizer`: None (the model
        folder's), a folder path, or a fast tokenizer object. `seed` seeds the draws of requests
        without their own seed (None: the OS's entropy). `task`: generate, embed, classify or score;
        "auto" reads it from the folder's architectures as vLLM does (engine/pooling/model);
        `pooler_config`: {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} over the model
        folder's own (engine/pooling). `image_limit`: the most images a prompt may carry;
        `mm_processor_kwargs`: the image processor's settings (Qwen2-VL's min/max pixels)."""
        config = config if config is not None else EngineConfig()
        self._image_limit, self._mm_kwargs = image_limit, dict(mm_processor_kwargs or {})
        if not is_seed(seed):
            raise SettingError("LLM", "seed", SEED_EXPECTED, seed)
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device, model)
        task = resolve_task(model, task)
        if task not in TASKS:
            raise ValueError(f"LLM(task={task!r}): must be one of 'auto', {', '.join(map(repr, TASKS))}")
        if task != "generate" and config.enable_lora:
            raise ValueError(f"LLM(task={task!r}, enable_lora=True): LoRA adapters serve task 'generate' only")
        self.task, self._model_path, self._pooler_config = task, model, pooler_config
        self.seed, self.dtype, self._device = seed, torch_dtype, torch_device
        self._pooling: PoolingModel | None = None
        self._tp: TensorParallelGroup | None = None
        self._vision: VisionModel | None = None
        self._lora: LoRAAdapters | None = None
        if task != "generate" and config.tensor_parallel_size > 1:
            raise ValueError(f"LLM(task={task!r}): tensor_parallel_size > 1 serves task 'generate' only")
        if runs_on_engine(model, task):
            self.hf_config = self._init_engine(tokenizer, config)
        else:  # encoders run through transformers
            self.hf_config = self._init_encoder(tokenizer, config)

    def _init_encoder(self, tokenizer: Any, config: EngineConfig) -> Any:
        """A pooling LLM over an encoder (BERT-style), run by transformers; its model config."""
        model, device = self._model_path, self._device
        self.config: EngineConfig | ResolvedConfig = config
        self.tokenizer = load_tokenizer(tokenizer, model)
        # padded tokens per transformers batch
        budget = config.max_num_batched_tokens or platform_for(device).max_num_batched_tokens
        self._pooling = PoolingModel.build(model, self.task, device, self.dtype, budget, None, self._pooler_config)
        hf = self._pooling.hf
        if hf is None:  # build() runs every model the engine cannot through transformers
            raise RuntimeError(f"{model}: no transformers model was built for task {self.task!r}")
        self.max_model_len = config.max_model_len or int(getattr(hf.config, "max_position_embeddings", 0) or 2048)
        return hf.config

    def _init_engine(self, tokenizer: Any, config: EngineConfig) -> Any:
        """The engine (runner, KV pool, scheduler, sampler) over the model's weights; its model config."""
        model, device, dtype = self._model_path, self._device, self.dtype
        model_config = AutoConfig.from_pretrained(model)
        vision = is_vision_config(model_config)
        resolved = self._resolve(model_config, vision, config)  # why first: fail before loading
        if self._mm_kwargs and not vision:
            raise ValueError(f"LLM(mm_processor_kwargs=...): {model} is not a vision-language model")
        platform = platform_for(device)
        platform.prepare_process()
        self._tp = start_tensor_parallel(model, resolved, device, dtype)  # None: one device
        if vision:  # images in: engine/vision
            self._vision = load_vision_model(model, device, dtype, self._mm_kwargs)
            hf_model: Any = self._vision.lm
        else:
            pooling = self.task != "generate"
            hf_model = self._tp.model if self._tp is not None else load_model(model, device, dtype, pooling)
        # the device's measured kernels (the CPU's linears); not under TP: see README, tensor parallelism
        self.native_linears = platform.install_kernels(hf_model, dtype) if self._tp is None else 0
        lora: dict[str, Any] = {}  # why before the pool: the adapter slots' memory is not the KV cache's
        if resolved.enable_lora:
            lora["lora"], self._lora = install_lora(hf_model, resolved, hf_model.config, device, dtype)
        spec = kv_spec(hf_model.config)
        measured = self._tp.kv_budget if self._tp is not None else None
        blocks, self.memory_profile = kv_pool_blocks(hf_model, spec, resolved, device, dtype, measured_budget=measured)
        self.tokenizer = load_tokenizer(tokenizer, model)
        sampler, eos, vocab_size = make_sampler(hf_model, self.tokenizer, self.seed, device)
        make_runner: Any = partial(ShardedRunner, self._tp) if self._tp is not None else ModelRunner  # rank 0's
        runner = make_runner(hf_model, spec, resolved, blocks, device, dtype, sampler=sampler, **lora)
        if self._vision is not None:
            self._vision.check_runner(runner, resolved.max_num_batched_tokens)
            runner.vision = self._vision.inputs(resolved.encoder_cache_tokens)
        block_manager = BlockManager(blocks, runner.block_size, resolved.enable_prefix_caching)
        scheduler = Scheduler(resolved, block_manager, resolved.max_model_len)
        self.config, self.max_model_len = resolved, resolved.max_model_len
        self.engine = Engine(scheduler, runner, self.tokenizer, eos, vocab_size)
        return hf_model.config

    def _resolve(self, model_config: Any, vision: bool, config: EngineConfig) -> ResolvedConfig:
        """`config` for this device and model, from the model's config.json (no weights read yet)."""
        if vision:
            check_vision_config(model_config, config.tensor_parallel_size)
        else:
            check_config(model_config)
        return resolve(
            config,
            platform_for(self._device),
            max_model_len=resolve_max_model_len(model_config, config.max_model_len),
            dtype=self.dtype,
            head_dim=kv_spec(model_config).head_dim,
            softcap=has_softcap(model_config),
            # why: pooling forwards run eager, compiling would serve nothing (a VLM's splice runs
            # eager before its compiled language model: runner/compiled_forward)
            compiles=self.task == "generate",
        )

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate(sampling_params=None) uses."""
        return SamplingParams()

    def close(self) -> None:
        """Stop the tensor-parallel worker processes, if any (also done when the LLM is collected)."""
        if self._tp is not None:
            self._tp.close()

    @property
    def stats(self) -> dict[str, int]:
        """Engine counters: steps, requests, errors, prefill/decode/cached/output tokens, preemptions."""
        return self.engine.stats.as_dict()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
        *,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order (vLLM's offline `LLM.generate`).

        `prompts`: a string, a `{"prompt": str}` or `{"prompt_token_ids": [...]}` dict, a list of
        token ids, or a list of these. `sampling_params`: one for all, one per prompt, or None for
        the defaults. `use_tqdm` is accepted and ignored (library code shows no bars);
        `lora_request`: None (the base model), a LoRARequest for all, or one (or None) per prompt,
        with enable_lora; an adapter that cannot be read or run makes its prompts error outputs.
        `on_output` is called with each output as it finishes.
        """
        if lora_request is not None and self._lora is None:
            raise ValueError(f"LLM.generate: {NOT_ENABLED}")
        if not hasattr(self, "engine"):
            raise ValueError(f"LLM(task={self.task!r}) on {self._model_path} is a pooling model: it cannot generate")
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            raise TypeError("prompts: a flat list of ints is ambiguous; pass [[...ids]] or {'prompt_token_ids': [...]}")
        extra_keys = ("multi_modal_data",) if self._vision is not None else ()
        encoded = [encode_prompt(self.tokenizer, i, p, extra_keys) for i, p in enumerate(items)]
        extras = [NO_EXTRAS] * len(encoded)
        for i, item in enumerate(items):
            data = item.get("multi_modal_data") if isinstance(item, dict) else None
            if data is None or self._vision is None:  # a text-only model's encode_prompt refused the key
                continue
            ids, extras[i] = self._vision.prompt(encoded[i][0], data, f"prompt {i}")
            if self._image_limit is not None and len(extras[i].image_hashes) > self._image_limit:
                raise ValueError(
                    f"prompt {i}: {len(extras[i].image_hashes)} images, more than limit_mm_per_prompt's "
                    f"{self._image_limit}"
                )
            encoded[i] = (ids, encoded[i][1])
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(encoded)
        params = list(sampling_params)  # one per prompt (Engine.generate refuses a count that differs)
        refusals = None
        if lora_request is not None and self._lora is not None:  # each prompt's adapter joins its extras
            adapters, refusals = self._lora.resolve(per_prompt(lora_request, len(encoded)))
            extras = [replace(x, adapter_hash=a.adapter_hash) for x, a in zip(extras, adapters, strict=True)]
        token_ids = [ids for ids, _ in encoded]
        texts = [t for _, t in encoded]
        return self.engine.generate(token_ids, params, on_output, texts, extras, refusals)

    def pooling_model(self) -> PoolingModel:
        """The pooling side of this LLM; on a generate LLM, embeddings through its engine."""
        if self._pooling is None:
            if self._tp is not None:  # why: rank 0 alone would wait in the shards' all-reduce until it timed out
                raise ValueError("LLM.embed/classify/score: tensor_parallel_size > 1 serves task 'generate' only")
            task, engine = "embed" if self.task == "generate" else self.task, self.engine
            budget = engine.scheduler.config.max_num_batched_tokens
            self._pooling = PoolingModel.build(
                self._model_path, task, self._device, self.dtype, budget, engine, self._pooler_config
            )
        return self._pooling
