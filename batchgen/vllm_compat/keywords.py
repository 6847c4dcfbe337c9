"""vLLM's `LLM(...)` keywords -> batchgen's engine settings: a script written for vLLM constructs ours.

Clients pass vLLM's constructor keywords with neutral values (lm-evaluation-harness always sends
`seed`, `tensor_parallel_size=1`, `trust_remote_code=False`, `revision=None`, `quantization=None`,
`enable_lora=False`, `max_lora_rank=16`, ...). Each keyword is one of:
  * mapped onto a setting of ours: `enforce_eager=True` -> `compile=False` (no torch.compile, no
    CUDA graphs), `num_gpu_blocks_override` -> `num_kv_blocks`, `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens`, `block_size`, `gpu_memory_utilization`, `enable_prefix_caching`
    (EngineConfig's own names; None means our default), `seed` (the sampler's generator for
    requests without their own seed: unseeded random sampling repeats for a given LLM seed);
  * accepted with any valid value because it changes no output here (`swap_space`: batchgen
    recomputes a preempted sequence rather than swapping it; `disable_log_stats`;
    `enable_chunked_prefill`: prefills are always chunked, as in vLLM V1);
  * accepted only with its neutral value and refused otherwise, with a message saying what
    batchgen does instead (`trust_remote_code=True`, a `revision`, `quantization`, ...); `enable_lora`, `max_loras`,
    `max_lora_rank` and `max_cpu_loras` are EngineConfig's own (engine/lora).
Every other field of vLLM's EngineArgs is accepted at vLLM's default and refused otherwise
(arg_rules); anything else goes on to EngineConfig, which refuses an unknown name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import MAX_LOGPROBS, is_int
from batchgen.vllm_compat.arg_rules import DEFAULTS, check_unused


def _is(*values: object) -> Callable[[Any], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


def _number_at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= low


_bool = _is(True, False)
_none_or_bool = _is(None, True, False)
_LOCAL_ONLY = "batchgen reads a local model folder as it is and downloads nothing"
_ONE_DEVICE = (
    "batchgen splits a model over devices with tensor_parallel_size only; "
    "scale out with the shards or ray executors (one engine per replica)"
)

# keyword -> (is it accepted, what is accepted, what batchgen does instead)
_KEYWORDS: dict[str, tuple[Callable[[Any], bool], str, str]] = {
    "trust_remote_code": (_is(False), "False", "batchgen runs transformers' built-in architectures only"),
    "revision": (_is(None), "None", f"{_LOCAL_ONLY}: check the revision out into a folder and pass its path"),
    "tokenizer_revision": (_is(None), "None", f"{_LOCAL_ONLY}: pass the tokenizer's folder as tokenizer="),
    "code_revision": (_is(None), "None", "batchgen runs no code from the model folder"),
    "hf_token": (_is(None, False), "None", _LOCAL_ONLY),
    "download_dir": (_is(None), "None", _LOCAL_ONLY),
    "hf_overrides": (_is(None, {}), "None", "edit config.json in the model folder"),
    "load_format": (_is("auto"), "'auto'", "batchgen loads weights with transformers' from_pretrained"),
    "tokenizer_mode": (
        _is("auto", "hf"),
        "'auto' or 'hf'",
        "batchgen uses the model's fast (Rust) tokenizer, which its stop checks and detokenization need",
    ),
    "skip_tokenizer_init": (
        _is(False),
        "False",
        "batchgen needs the tokenizer for stop checks; use SamplingParams(detokenize=False) for token ids only",
    ),
    "quantization": (_is(None), "None", "batchgen runs the weights in `dtype` (float32, float16 or bfloat16)"),
    "kv_cache_dtype": (_is("auto"), "'auto'", "batchgen keeps K/V in the model's dtype"),
    "calculate_kv_scales": (_is(False), "False", "batchgen keeps K/V in the model's dtype"),
    "cpu_offload_gb": (_is(0, 0.0), "0", "batchgen keeps every weight on the device"),
    "pipeline_parallel_size": (_is(1), "1", _ONE_DEVICE),
    "data_parallel_size": (_is(1), "1", _ONE_DEVICE),
    "distributed_executor_backend": (_is(None, "uni", "mp"), "None, 'uni' or 'mp'", _ONE_DEVICE),
    "enable_expert_parallel": (_is(False), "False", _ONE_DEVICE),
    "compilation_config": (_is(None), "None", "use enforce_eager=True (or compile=True/False)"),
    "speculative_config": (_is(None), "None", "batchgen has no speculative decoding"),
    # (`task` is LLM's own parameter; `runner`, `convert` and `generation_config`: arg_rules)
    "allowed_local_media_path": (lambda v: isinstance(v, str), "a path", "batchgen's chat reads local image paths"),
    "mm_processor_kwargs": (
        lambda v: v is None or isinstance(v, dict),
        "None or a dict",
        "Qwen2-VL's min_pixels / max_pixels (LLM reads them before this check; others are refused there)",
    ),
    "limit_mm_per_prompt": (
        lambda v: (
            v is None or (isinstance(v, dict) and all(k == "image" and is_int(n) and n >= 0 for k, n in v.items()))
        ),
        "None or {'image': n >= 0}",
        "batchgen takes images only (LLM reads the image limit before this check)",
    ),
    "logits_processors": (_is(None), "None", "use SamplingParams' penalties, logit_bias, bad_words or structured"),
    "guided_decoding_backend": (_is(None, "auto", "xgrammar"), "'auto' or 'xgrammar'", "batchgen uses xgrammar"),
    "structured_outputs_config": (_is(None), "None", "batchgen uses xgrammar with its defaults"),
    "enable_sleep_mode": (_is(False), "False", "batchgen frees memory when the LLM is dropped"),
    "disable_sliding_window": (_is(False), "False", "batchgen runs sliding-window layers exactly as configured"),
    "scheduling_policy": (_is("fcfs"), "'fcfs'", "batchgen schedules waiting requests in order"),
    "max_logprobs": (
        lambda v: is_int(v) and 0 <= v <= MAX_LOGPROBS,
        f"an integer in [0, {MAX_LOGPROBS}]",
        f"batchgen returns at most {MAX_LOGPROBS} alternatives per token",
    ),
    # No effect on any output here, so any valid value is accepted.
    "swap_space": (_number_at_least(0), "a number >= 0", "preempted sequences are recomputed, never swapped"),
    "disable_log_stats": (_bool, "True or False", ""),
    "disable_custom_all_reduce": (_bool, "True or False", ""),
    "disable_async_output_proc": (_bool, "True or False", ""),
    "use_v2_block_manager": (_bool, "True or False", ""),
    "enable_chunked_prefill": (_none_or_bool, "None, True or False", ""),
    "max_seq_len_to_capture": (_number_at_least(1), "an integer >= 1", ""),
}

# EngineConfig settings whose None means "our default" in vLLM's spelling too (dropped when None).
_NONE_IS_DEFAULT = ("enable_prefix_caching", "gpu_memory_utilization", "attention_backend", "enable_lora")
_MAPPED = ("enforce_eager", "num_gpu_blocks_override")
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def adapt_vllm_keywords(keywords: dict[str, Any]) -> dict[str, Any]:
    """The EngineConfig settings that `keywords` (LLM's **settings) stand for.

    vLLM-only keywords are checked and removed, mapped ones renamed; the rest is returned as is
    for EngineConfig to check. A refused value is a ValueError naming the keyword, the value,
    what is accepted and what batchgen does instead.
    """
    settings = dict(keywords)
    for name, (accepted, allowed, instead) in _KEYWORDS.items():
        if name in settings and name not in _ENGINE_FIELDS:
            value = settings.pop(name)
            if not accepted(value) and not (name in DEFAULTS and value == DEFAULTS[name]):
                why = f": {instead}" if instead else ""
                raise ValueError(f"LLM({name}={value!r}) is not supported (accepted: {allowed}){why}")
    for name in [n for n in settings if n in DEFAULTS and n not in _ENGINE_FIELDS and n not in _MAPPED]:
        check_unused(name, settings.pop(name))  # the other fields of vLLM's EngineArgs
    for name in _NONE_IS_DEFAULT:
        if name in settings and settings[name] is None:
            del settings[name]
    _enforce_eager(settings)
    if "num_gpu_blocks_override" in settings:
        blocks = settings.pop("num_gpu_blocks_override")
        if blocks is not None:
            if settings.get("num_kv_blocks") not in (None, blocks):
                raise ValueError(
                    f"LLM(num_gpu_blocks_override={blocks!r}, num_kv_blocks={settings['num_kv_blocks']!r}): "
                    "they are one setting; pass one of them"
                )
            settings["num_kv_blocks"] = blocks
    return settings


def _enforce_eager(settings: dict[str, Any]) -> None:
    """vLLM's enforce_eager=True (no compilation, no CUDA graphs) is our compile=False."""
    if "enforce_eager" not in settings:
        return
    eager = settings.pop("enforce_eager")
    if eager not in (None, True, False):
        raise ValueError(f"LLM(enforce_eager={eager!r}) must be True, False or None")
    if eager:
        if settings.get("compile") is True:
            raise ValueError("LLM(enforce_eager=True, compile=True) contradict each other; pass one of them")
        settings["compile"] = False


# vLLM's dtype spellings that are not torch's names
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def vllm_dtype(dtype: Any) -> Any:
    """vLLM's `dtype` name as ours ('half' -> 'float16', 'float' -> 'float32'); others unchanged."""
    return _DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype


def render_options(
    chat_template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[dict[str, Any]] | None,
    chat_template_kwargs: dict[str, Any] | None,
) -> dict[str, Any]:
    """LLM.chat's keywords for the tokenizer's apply_chat_template (vLLM's names); a key of
    chat_template_kwargs that is one of the named keywords is a TypeError (pass it by name)."""
    named: dict[str, Any] = {
        "chat_template": chat_template,
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": continue_final_message,
        "tools": tools,
    }
    extra = dict(chat_template_kwargs or {})
    clash = sorted(set(extra) & (set(named) | {"tokenize", "conversation"}))
    if clash:
        raise TypeError(f"LLM.chat(chat_template_kwargs=...): {clash} are LLM.chat keywords; pass them by name")
    return {**extra, **{k: v for k, v in named.items() if v is not None}}
