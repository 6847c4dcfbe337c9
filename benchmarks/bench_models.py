"""The benchmark's models, saved as ordinary local HF folders: the demo model and a larger Llama.

The demo model is `sample_data/demo-model` when its weights are committed; until then a
random-weight stand-in of the same config shape (same cost per token, meaningless text) with a
byte-level tokenizer. The larger model is a random-weight Llama of ~57M parameters built with
`from_config`, where matrix work rather than Python dominates a step; it borrows the demo
tokenizer (or the stand-in one) so text workloads run on it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedTokenizerFast

from scripts.train_demo_model import demo_config

REPO = Path(__file__).resolve().parents[1]
DEMO_DIR = REPO / "sample_data" / "demo-model"
EOS = "<|endoftext|>"


@dataclass
class BenchModel:
    name: str  # "demo" or "large"
    path: Path
    params: int
    standin: bool  # random weights standing in for the trained demo model
    description: str


def large_config(vocab_size: int, eos_id: int) -> LlamaConfig:
    """~57M parameters: 8 layers, hidden 768, 12 query heads over 4 K/V heads, head_dim 64."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: 256 byte tokens plus EOS (id 256); any text round-trips."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    wrapped.model_max_length = 1024
    return wrapped


def demo_is_trained() -> bool:
    return (DEMO_DIR / "model.safetensors").is_file()


def _save(config: LlamaConfig, tokenizer: PreTrainedTokenizerFast, path: Path, seed: int) -> int:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(DEMO_DIR) if demo_is_trained() else byte_tokenizer()


def demo_model(workdir: Path) -> BenchModel:
    """The trained demo model, or a random-weight stand-in of its shape saved under `workdir`."""
    if demo_is_trained():
        model = AutoModelForCausalLM.from_pretrained(DEMO_DIR)
        params = sum(p.numel() for p in model.parameters())
        return BenchModel("demo", DEMO_DIR, params, False, "sample_data/demo-model (trained)")
    tokenizer = byte_tokenizer()
    path = workdir / "demo-standin"
    # why vocab 4096: the demo tokenizer's size, so the LM head costs what the real one does
    params = _save(demo_config(4096, tokenizer.eos_token_id), tokenizer, path, seed=0)
    return BenchModel("demo", path, params, True, "random-weight stand-in of the demo model's shape")


def large_model(workdir: Path) -> BenchModel:
    """A random-weight ~57M Llama saved under `workdir`, with the demo (or stand-in) tokenizer."""
    tokenizer = _tokenizer()
    path = workdir / "llama-57m"
    # why the model's vocab is 4096 even with the 257-token stand-in: same LM-head cost either way
    vocab = max(4096, len(tokenizer))
    params = _save(large_config(vocab, tokenizer.eos_token_id), tokenizer, path, seed=0)
    return BenchModel("large", path, params, False, "random-weight Llama (8 layers, hidden 768, GQA 12/4)")


def build(names: list[str], workdir: Path) -> list[BenchModel]:
    builders = {"demo": demo_model, "large": large_model}
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise ValueError(f"unknown models {unknown}; choose from {sorted(builders)}")
    return [builders[n](workdir) for n in names]
