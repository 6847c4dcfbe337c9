"""vLLM's engine arguments (its `EngineArgs` fields) as LLM keywords: what a vLLM script passes with
`LLM(**vars(args))` after `EngineArgs.add_cli_args(parser)`.

Every field of the mirrored release (engine_table): `runner` / `convert` choose the task;
`generation_config` "auto" makes the folder's generation_config.json the default SamplingParams
("vllm": SamplingParams()' own); an unused field is accepted at vLLM's default, refused otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchgen.vllm_compat.engine_table import ENGINE_ARGS

DEFAULTS: dict[str, Any] = {name: default for name, _, _, default in ENGINE_ARGS}
_RUNNERS = ("auto", "generate", "pooling")
_CONVERTS = ("auto", "none", "embed", "classify")
_POOLING_TASKS = ("embed", "classify", "score")


def check_unused(name: str, value: Any) -> None:
    """ValueError unless `value` is vLLM's default for the engine argument `name` (one batchgen does not use)."""
    default = DEFAULTS[name]
    if value is None or value == default:
        return
    raise ValueError(
        f"LLM({name}={value!r}) is not supported (accepted: {default!r}, vLLM's default): "
        "batchgen does not implement this vLLM engine argument"
    )


def task_of(task: str, settings: dict[str, Any]) -> str:
    """LLM's task ("auto", "pooling" or a task name) from `task` and vLLM's `runner` / `convert`
    (removed from `settings`); a contradiction is a ValueError naming both."""
    runner, convert = settings.pop("runner", "auto"), settings.pop("convert", "auto")
    if runner not in _RUNNERS:
        raise ValueError(f"LLM(runner={runner!r}) must be one of {', '.join(map(repr, _RUNNERS))}")
    if convert not in _CONVERTS:
        raise ValueError(f"LLM(convert={convert!r}) must be one of {', '.join(map(repr, _CONVERTS))}")
    implied = (
        convert if convert in ("embed", "classify") else {"generate": "generate", "pooling": "pooling"}.get(runner)
    )
    if implied is None or task == implied:
        return task
    if task == "auto":
        return implied
    fits = (
        task in _POOLING_TASKS if implied == "pooling" else task == implied or (implied, task) == ("classify", "score")
    )
    if not fits:
        raise ValueError(f"LLM(task={task!r}) contradicts runner={runner!r}, convert={convert!r}; pass one of them")
    return task


def generation_mode(settings: dict[str, Any]) -> str:
    """vLLM's `generation_config` (removed from `settings`): "vllm" (the default here) or "auto"."""
    mode = settings.pop("generation_config", "vllm")
    if mode not in ("auto", "vllm"):
        raise ValueError(
            f"LLM(generation_config={mode!r}) is not supported (accepted: 'auto' or 'vllm'): "
            "batchgen reads generation_config.json from the model folder itself"
        )
    return str(mode)


# generation_config.json key -> SamplingParams field (vLLM's `get_diff_sampling_param` reads the same)
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(model_path: str) -> dict[str, Any]:
    """The SamplingParams fields the folder's generation_config.json sets ({} without one)."""
    file = Path(model_path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not readable JSON ({exc})") from None
    return {ours: values[key] for key, ours in _GENERATION_KEYS.items() if values.get(key) is not None}
