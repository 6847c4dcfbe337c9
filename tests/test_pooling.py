"""Pooling (embed, classify, score) against transformers' own forward and sentence-transformers'
encode: embeddings to 1e-5 in float32 for a decoder through batchgen's engine (packed varlen
chunks, prefix reuse) and a BERT through transformers; class probabilities and pair scores too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from batchgen import LLM
from batchgen.engine.pooling.config import PoolingConfigError, PoolingParams, resolve_pooling
from testkit.pooling_models import (
    save_llama_classifier,
    save_tiny_bert,
    write_sentence_transformers,
)
from tests.conftest import build_tokenizer, save_tiny_llama

PREFIX = "once upon a time there was a little cat who liked to play in the sun "
TEXTS = [PREFIX * 3 + "with her friend", PREFIX * 3 + "dog", "the sun", PREFIX * 6, "cat", PREFIX + "once"]


def reference(path: Path, texts: list[str], method: str, normalize: bool = True) -> np.ndarray:
    """transformers' own forward (one text at a time, no padding) + the pooling, in float32."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.no_grad():
            hidden = model(input_ids=ids).last_hidden_state[0]  # [L, H]
        vec = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
        rows.append(torch.nn.functional.normalize(vec, dim=-1) if normalize else vec)
    return torch.stack(rows).numpy()


def embeddings(outputs: list[Any]) -> np.ndarray:
    return np.array([o.outputs.embedding for o in outputs], dtype=np.float32)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llama-embed"), build_tokenizer())


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("bert"))


@pytest.mark.parametrize("method", ["last", "mean"])
def test_decoder_embeddings_match_transformers(llama_dir: Path, method: str) -> None:
    # a small token budget: the long prompts run as chunks over several packed forwards
    llm = LLM(str(llama_dir), task="embed", pooler_config={"pooling_type": method}, max_num_batched_tokens=48)
    outs = llm.embed(TEXTS)
    np.testing.assert_allclose(embeddings(outs), reference(llama_dir, TEXTS, method), atol=1e-5)
    cached = [o.num_cached_tokens for o in outs]
    if method == "last":  # the second text shares three prefixes' worth of full blocks with the first
        assert cached[1] > 0 and cached[1] % llm.config.block_size == 0
    else:  # mean pooling needs every position's hidden state: nothing comes from the cache
        assert cached == [0] * len(TEXTS)
    assert [o.prompt_token_ids for o in outs] == [llm.tokenizer(t)["input_ids"] for t in TEXTS]


def test_generate_llm_embeds_through_its_engine(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    np.testing.assert_allclose(embeddings(llm.embed(TEXTS[:3])), reference(llama_dir, TEXTS[:3], "last"), atol=1e-5)


def test_bert_embeddings_match_transformers(bert_dir: Path) -> None:
    llm = LLM(str(bert_dir), task="embed", max_num_batched_tokens=64)  # several padded batches
    np.testing.assert_allclose(embeddings(llm.embed(TEXTS)), reference(bert_dir, TEXTS, "cls"), atol=1e-5)
    mean = LLM(str(bert_dir), task="embed", pooler_config={"pooling_type": "MEAN", "normalize": False})
    np.testing.assert_allclose(embeddings(mean.embed(TEXTS)), reference(bert_dir, TEXTS, "mean", False), atol=1e-5)


@pytest.mark.parametrize(("kind", "method"), [("bert", "mean"), ("bert", "cls"), ("llama", "last"), ("llama", "mean")])
def test_sentence_transformers_encode_matches(tmp_path: Path, kind: str, method: str) -> None:
    from sentence_transformers import SentenceTransformer

    path = save_tiny_bert(tmp_path / "m") if kind == "bert" else save_tiny_llama(tmp_path / "m", build_tokenizer())
    write_sentence_transformers(path, method, normalize=True, hidden_size=64)
    expected = SentenceTransformer(str(path), device="cpu").encode(TEXTS, batch_size=4)
    ours = LLM(str(path), task="embed").embed(TEXTS)  # the pooling comes from the folder's modules
    np.testing.assert_allclose(embeddings(ours), expected, atol=1e-5)


def test_matryoshka_dimensions_truncate_then_normalize(bert_dir: Path) -> None:
    llm = LLM(str(bert_dir), task="embed", pooler_config={"normalize": False})
    full = embeddings(llm.embed(TEXTS))
    short = embeddings(llm.embed(TEXTS, PoolingParams(dimensions=16, normalize=True)))
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert short.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(short, expected, atol=1e-6)


def test_classify_probs_match_transformers(tmp_path: Path) -> None:
    bert = save_tiny_bert(tmp_path / "bert", num_labels=3)
    llama = save_llama_classifier(tmp_path / "llama", build_tokenizer(), 3)
    for path, on_engine in ((bert, False), (llama, True)):
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
        llm = LLM(str(path), task="classify", max_num_batched_tokens=64)
        # a decoder's head runs over the engine's last-token hidden state; an encoder runs in transformers
        assert (llm.pooling_model().engine is not None) is on_engine
        outs = llm.classify(TEXTS)
        for text, out in zip(TEXTS, outs):
            with torch.no_grad():
                logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
            probs = torch.softmax(logits, -1)
            np.testing.assert_allclose(out.outputs.probs, probs.numpy(), atol=1e-5)
            assert out.outputs.label == model.config.id2label[int(probs.argmax())]
        if on_engine:  # TEXTS[1] shares whole blocks with TEXTS[0]: served from the prefix cache
            assert outs[1].num_cached_tokens > 0


def test_decoder_reward_model_pair_scores(tmp_path: Path) -> None:
    path = save_llama_classifier(tmp_path / "rm", build_tokenizer(), 1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    outs = LLM(str(path), task="score").score(PREFIX, ["cat", "the sun dog"])
    for doc, out in zip(["cat", "the sun dog"], outs):
        with torch.no_grad():
            logit = model(**tokenizer(PREFIX, doc, return_tensors="pt")).logits[0, 0]
        assert out.outputs.score == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)


def test_cross_encoder_pair_scores(tmp_path: Path) -> None:
    path = save_tiny_bert(tmp_path / "ce", num_labels=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    docs = ["the cat liked the sun", "a dog", "once upon a time"]
    outs = LLM(str(path), task="score").score("who liked the sun", docs)
    for doc, out in zip(docs, outs):
        with torch.no_grad():
            logit = model(**tokenizer("who liked the sun", doc, return_tensors="pt")).logits[0, 0]
        assert out.outputs.score == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)


def test_embedding_model_scores_by_cosine(bert_dir: Path) -> None:
    llm = LLM(str(bert_dir), task="score")
    left, right = TEXTS[:3], TEXTS[3:]
    a, b = reference(bert_dir, left, "cls"), reference(bert_dir, right, "cls")
    scores = [o.outputs.score for o in llm.score(left, right)]
    np.testing.assert_allclose(scores, (a * b).sum(1), atol=1e-5)


def test_bad_prompts_are_error_outputs(bert_dir: Path) -> None:
    llm = LLM(str(bert_dir), task="embed")
    outs = llm.embed([[], "the cat", list(range(5, 5 + 300)), [2, 100_000]])
    assert outs[0].error is not None and "no tokens" in outs[0].error and outs[0].outputs is None
    assert outs[1].error is None and outs[1].outputs is not None
    assert outs[2].error is not None and "context is 256" in outs[2].error
    assert outs[3].error is not None and "[100000] are outside the vocabulary [0, 5)" in outs[3].error


def test_an_id_past_the_vocabulary_is_that_row_error_on_the_engine(llama_dir: Path) -> None:
    """Through the engine's packed forward, an id past the embedding table would crash the whole batch."""
    llm = LLM(str(llama_dir), task="embed")
    outs = llm.embed(["the cat", [5, 100_000], "the sun"])
    assert outs[1].error is not None and "outside the vocabulary" in outs[1].error and outs[1].outputs is None
    alone = llm.embed(["the cat", "the sun"])
    for out, ref in zip([outs[0], outs[2]], alone):
        assert out.outputs is not None and ref.outputs is not None
        assert np.allclose(out.outputs.embedding, ref.outputs.embedding, atol=1e-6)


def test_unsupported_sentence_transformers_module_is_named(bert_dir: Path, tmp_path: Path) -> None:
    modules = [{"idx": 0, "name": "0", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PoolingConfigError, match=r"modules\.json.*Dense"):
        resolve_pooling(tmp_path, is_decoder=False)
    assert resolve_pooling(bert_dir, is_decoder=False).method == "cls"
    assert resolve_pooling(bert_dir, is_decoder=True, method="mean", normalize=False).normalize is False


def test_an_aborted_pool_gives_its_blocks_back_and_forgets_its_hashes(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), task="embed", max_num_batched_tokens=48)
    model = llm.pooling_model()
    assert model.engine is not None
    blocks = model.engine.scheduler.block_manager
    free = blocks.num_free_blocks
    steps: list[int] = []

    def stop_at_second_step() -> None:  # what the job runner's interrupt check does on a signal
        steps.append(1)
        if len(steps) == 2:
            raise KeyboardInterrupt

    model.on_step = stop_at_second_step
    with pytest.raises(KeyboardInterrupt):
        llm.embed(TEXTS)
    assert blocks.num_free_blocks == free and not blocks._tables
    assert blocks.hash_to_block == {}  # nothing half-computed can be matched later
    model.on_step = None
    np.testing.assert_allclose(embeddings(llm.embed(TEXTS)), reference(llama_dir, TEXTS, "last"), atol=1e-5)


def test_truncate_prompt_tokens_keeps_the_last_tokens(bert_dir: Path) -> None:
    llm = LLM(str(bert_dir), task="embed")
    ids = llm.tokenizer(TEXTS[3])["input_ids"]
    assert len(ids) > 40
    cut = llm.embed(TEXTS[3], truncate_prompt_tokens=40)[0]
    assert cut.prompt_token_ids == ids[-40:]  # vLLM's left truncation
    np.testing.assert_allclose(cut.outputs.embedding, llm.embed([ids[-40:]])[0].outputs.embedding, atol=1e-6)
    with pytest.raises(NotImplementedError, match="lora_request"):
        llm.embed("cat", lora_request=object())
