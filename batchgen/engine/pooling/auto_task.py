"""`task="auto"`: which task a model folder serves, read from its config's architectures as vLLM's
`runner="auto"` / `convert="auto"` resolve it, so that `LLM(path)` on a classifier or an embedding
model loads it for that task instead of as a causal LM with a newly initialized LM head.

The rule: a sentence-transformers folder (modules.json) embeds; otherwise the first architecture
whose class name ends with a known suffix decides (generation heads first, then encoders and
embedding models, classifiers, reward models, and last any other `*Model`: a bare backbone
embeds); no match generates.
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
