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

VOCAB = 256
EOS_ID = 0
MAX_POS = 512


def _configs() -> dict[str, Any]:
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        max_position_embeddings=MAX_POS,
        initializer_range=0.25,
        tie_word_embeddings=False,
    )
    llama_like = dict(
        common, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    return {
        "llama": tf.LlamaConfig(**llama_like),
        "mistral": tf.MistralConfig(**llama_like, sliding_window=48),
        "qwen2": tf.Qwen2Config(
            **llama_like,
            use_sliding_window=True,
            sliding_window=40,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
        "qwen3": tf.Qwen3Config(**llama_like, head_dim=16),
        "phi3": tf.Phi3Config(**llama_like),
        "gemma2": tf.Gemma2Config(
            **llama_like,
            head_dim=16,
            sliding_window=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=16,
        ),
        "gemma3": tf.Gemma3TextConfig(
            **llama_like,
            head_dim=16,
            sliding_window=32,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "gpt2": tf.GPT2Config(
            **{k: v for k, v in common.items() if k != "max_position_embeddings"},
            n_positions=MAX_POS,
            n_embd=64,
            n_layer=2,
            n_head=4,
        ),
        "gpt_neox": tf.GPTNeoXConfig(
            **common, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
        ),
    }


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
    configs = _configs()

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = save_tiny_model(configs[arch], tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get
