"""Tiny pooling models for tests and the embedding benchmark (no downloads): a BERT with a
WordPiece tokenizer (with or without a classification head), a Llama classifier, and the
sentence-transformers files (modules.json, 1_Pooling/config.json, Normalize) that turn a model
folder into one sentence-transformers loads.

Why here (testkit/, beside the package, not in the wheel): the tests and
benchmarks/embed_throughput.py build the same models.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WORDS = "the a cat dog sun play little friend once upon time there was who liked to in with her".split()
_ST_MODES = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


def bert_tokenizer(path: Path) -> Any:
    """A BertTokenizerFast over a small WordPiece vocabulary, saved in `path`."""
    from transformers import BertTokenizerFast  # type: ignore[attr-defined]  # transformers 5: an alias

    path.mkdir(parents=True, exist_ok=True)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,!?'")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *letters, *[f"##{c}" for c in letters]]
    (path / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"))
    tokenizer.save_pretrained(path)
    return tokenizer


def save_tiny_bert(path: Path, num_labels: int | None = None, seed: int = 0) -> Path:
    """A 2-layer BERT (random weights) with its tokenizer; `num_labels`: a classification head."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    tokenizer = bert_tokenizer(path)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    if num_labels is None:
        BertModel(config).save_pretrained(path)
    else:
        config.num_labels = num_labels
        config.id2label = {i: f"label_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
        BertForSequenceClassification(config).save_pretrained(path)
    return path


def save_llama_classifier(path: Path, tokenizer: Any, num_labels: int, seed: int = 0) -> Path:
    """A 2-layer Llama with a sequence-classification head (random weights) and `tokenizer`."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    config.num_labels = num_labels
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_sentence_transformers(
    path: Path, method: str, normalize: bool, hidden_size: int, max_seq_length: int = 256
) -> Path:
    """The files that make the model folder `path` a sentence-transformers model: Transformer
    (the folder itself), Pooling (`method`), and Normalize when asked."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2), encoding="utf-8")
    pooling: dict[str, Any] = {"word_embedding_dimension": hidden_size, "include_prompt": True}
    pooling.update({key: key == _ST_MODES[method] for key in _ST_MODES.values()})
    pooling.update(pooling_mode_max_tokens=False, pooling_mode_mean_sqrt_len_tokens=False)
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2), encoding="utf-8")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}), encoding="utf-8")
    return path
