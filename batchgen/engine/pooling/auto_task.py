"""`task="auto"`: which task a model folder serves, from its architectures as vLLM resolves it: a
sentence-transformers folder embeds; else the first architecture with a known class-name suffix
decides (a bare `*Model` embeds); no match generates.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

# class-name suffix -> task, tried in this order (the earlier, more specific suffixes win over "Model")
_SUFFIX_TASKS: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "generate"),
    ("ForConditionalGeneration", "generate"),
    ("ChatModel", "generate"),
    ("LMHeadModel", "generate"),
    ("ForTextEncoding", "embed"),
    ("EmbeddingModel", "embed"),
    ("ForSequenceClassification", "classify"),
    ("ClassificationModel", "classify"),
    ("ForRewardModeling", "embed"),
    ("RewardModel", "embed"),
    ("Model", "embed"),
)


def task_of_architectures(architectures: list[str]) -> str:
    """The task of the first architecture with a known suffix; "generate" when none has one."""
    for name in architectures:
        for suffix, task in _SUFFIX_TASKS:
            if name.endswith(suffix):
                return task
    return "generate"


def auto_task(path: str | Path) -> str:
    """The task `task="auto"` means for the model folder `path` (see the module docstring)."""
    if (Path(path) / "modules.json").is_file():  # sentence-transformers: even a *ForCausalLM embeds
        return "embed"
    architectures = getattr(AutoConfig.from_pretrained(path), "architectures", None) or []
    return task_of_architectures(list(architectures))


def resolve_task(path: str | Path, task: str) -> str:
    """LLM's task: "auto" as auto_task says, "pooling" (vLLM's runner="pooling") the folder's
    pooling task (classify for a classifier, else embed), any other name as given."""
    if task == "auto":
        return auto_task(path)
    if task == "pooling":
        found = auto_task(path)
        return "embed" if found == "generate" else found
    return task
