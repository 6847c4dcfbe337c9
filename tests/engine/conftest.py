"""Tiny random-weight models of every supported architecture, saved like real HF folders.

2 layers, hidden 64, a 256-token word-level tokenizer whose id 0 is EOS; weights drawn with a large
initializer range so greedy logits are not near-tied. Sliding windows are small (<= 48) so that
300-token prompts really exercise them. Nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchgen.engine.tiny_models import EOS_ID, VOCAB, tiny_configs

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gpt2", "gpt_neox"]


def build_word_tokenizer() -> Any:
    """A fast tokenizer over words "<eos>", "<unk>", "w2" .. "w255" (id i <-> "w{i}")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS_ID, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def save_tiny_model(config: Any, path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    build_word_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """tiny_model("llama") -> folder of a saved tiny model of that architecture (built once)."""
    built: dict[str, Path] = {}
    configs = tiny_configs()

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = save_tiny_model(configs[arch], tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get
