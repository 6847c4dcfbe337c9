"""`LLM(path)` with the default task="auto" serves what the folder is (vLLM's rule over the config's
architectures): a classifier classifies, checked against transformers' own forward, and an
embedding backbone embeds. A pooling run prints no load report for the keys it is expected to
lack (the causal LM's head, the classifier's `score` read apart), while a weight that is really
missing is still reported."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from batchgen import LLM
from batchgen.engine.pooling.model import auto_task, task_of_architectures
from testkit.pooling_models import save_llama_classifier, save_tiny_bert, write_sentence_transformers
from tests.conftest import build_tokenizer, save_tiny_llama

TEXTS = ["once upon a time", "the cat liked to play in the sun", "a little dog"]
REPORT_WORDS = ("LOAD REPORT", "MISSING", "UNEXPECTED", "newly initialized")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self) -> str:
        text, self.lines = "\n".join(self.lines), []
        return text


@pytest.fixture
def reports() -> Iterator[_Records]:
    """What transformers logs (its load report among it), whatever its own handlers print to."""
    handler, root = _Records(), logging.getLogger("transformers")
    level = root.level  # why set: an in-process `batchgen run --quiet` earlier in the session raises it
    root.setLevel(logging.WARNING)
    root.addHandler(handler)
    yield handler
    root.removeHandler(handler)
    root.setLevel(level)


def _classifier(tmp_path: Path, labels: int) -> Path:
    return save_llama_classifier(tmp_path / f"classifier-{labels}", build_tokenizer(), num_labels=labels)


def _reference_probs(path: Path) -> torch.Tensor:
    """transformers' own classifier forward, one text at a time: softmax (sigmoid for one label)."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    for text in TEXTS:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([tokenizer(text)["input_ids"]])).logits[0]  # [C]
        rows.append(torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, -1))
    return torch.stack(rows)


@pytest.mark.parametrize(
    ("architectures", "task"),
    [
        (["LlamaForCausalLM"], "generate"),
        (["GPT2LMHeadModel"], "generate"),
        (["Qwen2ForSequenceClassification"], "classify"),
        (["LlamaForRewardModeling"], "embed"),
        (["BertModel"], "embed"),
        (["XLMRobertaForSequenceClassification"], "classify"),
        (["SomethingUnknown"], "generate"),
        ([], "generate"),
    ],
)
def test_the_task_follows_the_architecture_suffix(architectures: list[str], task: str) -> None:
    assert task_of_architectures(architectures) == task


def test_folders_resolve_to_their_task(tmp_path: Path) -> None:
    llama = save_tiny_llama(tmp_path / "llama", build_tokenizer())
    assert auto_task(llama) == "generate"
    assert auto_task(_classifier(tmp_path, 2)) == "classify"
    assert auto_task(save_tiny_bert(tmp_path / "bert")) == "embed"
    assert auto_task(save_tiny_bert(tmp_path / "bert-cls", num_labels=2)) == "classify"
    write_sentence_transformers(llama, "mean", True, 64)  # a sentence-transformers *ForCausalLM embeds
    assert auto_task(llama) == "embed"


def test_a_classifier_folder_classifies_by_default_without_a_load_report(tmp_path: Path, reports: _Records) -> None:
    path = _classifier(tmp_path, 3)
    expected = _reference_probs(path)
    reports.take()
    llm = LLM(str(path), device="cpu", dtype="float32")
    assert llm.task == "classify"
    probs = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS)])
    err = reports.take()
    assert not [w for w in REPORT_WORDS if w in err], err
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=1e-5)


def test_a_reward_model_scores_without_a_load_report(tmp_path: Path, reports: _Records) -> None:
    path = _classifier(tmp_path, 1)
    expected = _reference_probs(path)[:, 0]
    reports.take()
    for task in ("auto", "score"):
        llm = LLM(str(path), device="cpu", dtype="float32", task=task)
        scores = torch.tensor([o.outputs.score for o in llm.score(TEXTS, TEXTS)])  # pairs: (a, a)
        assert scores.shape == (3,)
        single = torch.tensor([o.outputs.probs[0] for o in llm.classify(TEXTS)])
        torch.testing.assert_close(single, expected, atol=1e-5, rtol=1e-5)
        err = reports.take()
        assert not [w for w in REPORT_WORDS if w in err], (task, err)


def test_a_weight_really_missing_is_still_reported(tmp_path: Path, reports: _Records) -> None:
    path = _classifier(tmp_path, 2)
    weights = path / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    reports.take()
    LLM(str(path), device="cpu", dtype="float32")
    err = reports.take()
    assert "model.layers.0.mlp.up_proj.weight" in err and "MISSING" in err, err
    assert "lm_head" not in err and "score.weight" not in err, err


def test_generating_with_a_classifier_folder_still_reports_its_missing_lm_head(
    tmp_path: Path, reports: _Records
) -> None:
    path = _classifier(tmp_path, 2)
    reports.take()
    LLM(str(path), device="cpu", dtype="float32", task="generate")
    err = reports.take()
    assert "lm_head.weight" in err and "MISSING" in err, err
