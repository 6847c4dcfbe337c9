"""The committed demo model, tokenizer and sample prompts load offline and behave like a story model."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
MODEL_DIR = SAMPLE_DATA / "demo-model"
PROMPTS = SAMPLE_DATA / "prompts.parquet"
EOS = "<|endoftext|>"
COMMON_WORDS = {"the", "a", "and", "to", "was", "he", "she", "they", "it", "her", "his", "said", "with", "of", "in"}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model() -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()


def eos_ids(config: GenerationConfig) -> list[int]:
    value = config.eos_token_id
    return list(value) if isinstance(value, (list, tuple)) else [value]


def test_eos_is_endoftext_everywhere(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    assert tokenizer.eos_token == EOS
    assert tokenizer.convert_tokens_to_ids(EOS) == tokenizer.eos_token_id
    assert tokenizer.eos_token_id in eos_ids(GenerationConfig.from_pretrained(MODEL_DIR))
    assert tokenizer.eos_token_id in eos_ids(model.generation_config)


def test_model_shape_exercises_grouped_query_attention(model: PreTrainedModel) -> None:
    config = model.config
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 10_000_000


def test_tokenizer_round_trips_story_text(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "Lily said, “Look, a big dog!”\nThe dog wagged its tail. 123"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id not in ids


def test_chat_template_renders_with_generation_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "You tell short stories."},
        {"role": "user", "content": "Tell me about a cat."},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "You tell short stories." in text and "Tell me about a cat." in text
    assert text.index("short stories") < text.index("about a cat")
    assert text.rstrip().endswith("Assistant:")
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not without.rstrip().endswith("Assistant:")
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) > 5


def test_prompts_parquet_shape(tokenizer: PreTrainedTokenizerBase) -> None:
    table = pq.read_table(PROMPTS)
    assert {"id", "prompt", "category"} <= set(table.column_names)
    rows = table.to_pydict()
    assert table.num_rows >= 2000
    assert len(set(rows["id"])) == table.num_rows
    assert all(isinstance(p, str) and p.strip() for p in rows["prompt"])
    categories = set(rows["category"])
    assert 2 <= len(categories) <= 4
    # why: most rows share a few-shot preamble, which is what the prefix cache is measured on
    shared = sum(c != "opening" for c in rows["category"]) / table.num_rows
    assert shared >= 0.5
    lengths = [len(ids) for ids in tokenizer(rows["prompt"], add_special_tokens=False)["input_ids"]]
    assert max(lengths) + 128 <= 512


def test_greedy_generation_is_english_story_text(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    prompt = "Once upon a time, there was a little girl named Lily. One day, she"
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    new_tokens = out[0, ids.shape[1] :]
    assert len(new_tokens) > 0
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    words = re.findall(r"[a-z]+", text.lower())
    assert len(words) >= 5
    assert len(COMMON_WORDS & set(words)) >= 3, text
