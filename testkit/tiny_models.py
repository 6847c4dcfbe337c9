"""Tiny random-weight configs of every architecture the parity tests cover (no downloads), the
word-level tokenizer they are saved with, and the function that saves a random-weight model.

Why here (testkit/, beside the package, not in the wheel): the tests build their models from these,
and so does the prepared GPU check (benchmarks/gpu_check.py), which runs where pytest and the
tests' conftest are not importable.
2 layers, hidden 64, a 256-token vocabulary whose id 0 is EOS; a large initializer range so greedy
logits are not near-tied; sliding windows <= 48, so 300-token prompts really exercise them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 256
EOS_ID = 0
MAX_POS = 512


def tiny_configs() -> dict[str, Any]:
    """Architecture name -> its tiny transformers config."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        eos_token_id=EOS_ID,
        bos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        max_position_embeddings=MAX_POS,
        initializer_range=0.25,
        tie_word_embeddings=False,
    )
    llama_like: dict[str, Any] = dict(
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


def word_tokenizer(vocab: int = VOCAB) -> Any:
    """A fast tokenizer over words "<eos>" (id 0), "<unk>" (1), "w2" .. "w{vocab-1}" (id i <-> "w{i}"),
    so any id a model emits detokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<eos>": EOS_ID, "<unk>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def save_random_model(config: Any, path: Path, seed: int = 0, device: str = "cpu", dtype: Any = None) -> Path:
    """A random-weight model of `config` (built on `device`: fast on a GPU), saved to `path` in `dtype`
    (None: as built, float32) with word_tokenizer(config.vocab_size) and EOS = id 0 in its generation
    config."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    if dtype is not None:  # why: a 1B model saved in float32 is 5 GB to write and read back
        model.to(dtype)
    model.save_pretrained(path)
    word_tokenizer(config.vocab_size).save_pretrained(path)
    return path
