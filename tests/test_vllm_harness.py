"""lm-evaluation-harness's vLLM backend runs on batchgen's LLM and agrees with its HF backend.

The harness imports `vllm`; batchgen.vllm_compat.install() points that name at batchgen (our real
engine, not a stand-in). Three local tasks (JSON data files in the test's folder, no hub): a
multiple-choice task (log-likelihood of each choice), a rolling log-likelihood (perplexity) task
whose texts span several windows, and a greedy generate-until task. The reference is the
harness's own HF backend (transformers' forward and generate) on the same weights: every
log-likelihood must match to 1e-4 (float32) and every generated text exactly.

Why the model folder says max_position_embeddings = WINDOW + 2: the harness cuts rolling windows
of `max_length` tokens with its HF backend but `max_length - 2` with its vLLM backend, and its
vLLM backend reads `max_length` from `llm.llm_engine.model_config.max_model_len`. The HF backend
is told WINDOW, the LLM reads WINDOW + 2 from the folder, so both cut the same windows, and the
context length is read the way vLLM clients read it. (The rope of this Llama does not depend on
max_position_embeddings, so both backends run the same function.)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

DEMO_MODEL = Path(__file__).resolve().parents[1] / "sample_data" / "demo-model"
WINDOW = 48  # tokens per rolling window (the HF backend's max_length)

STORY = (
    "Once upon a time there was a little girl named Lily. She liked to play in the park with her dog. "
    "One day the sun was hot and the dog was tired, so they sat under a big tree. Lily gave the dog "
    "some water and they watched the birds fly over the pond. Then her mom called her home for dinner, "
    "and Lily ran back with a happy smile. "
)
MC_DOCS = [
    {"question": "Lily went to the park with her", "choices": [" dog.", " car.", " book."], "answer": 0},
    {"question": "The sun was very", "choices": [" hot.", " blue.", " sad."], "answer": 0},
    {"question": "Tom wanted to eat", "choices": [" a cake.", " the moon.", " a shoe."], "answer": 0},
    {"question": "The bird could", "choices": [" fly.", " swim.", " read."], "answer": 0},
]
PPL_DOCS = [{"text": STORY * 2}, {"text": STORY.replace("Lily", "Tom")}, {"text": "The cat sat on the mat."}]
GEN_DOCS = [
    {"prompt": "Once upon a time, there was a", "target": ""},
    {"prompt": "Lily and her mom went to the", "target": ""},
    {"prompt": "The little dog was", "target": ""},
]


def _task_yaml(name: str, data: Path, cache: Path, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"  cache_dir: {cache}\ntest_split: test\n{body}"
    )


TASKS = {
    "bg_choice": (
        MC_DOCS,
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n",
    ),
    "bg_rolling": (
        PPL_DOCS,
        "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n",
    ),
    "bg_until": (
        GEN_DOCS,
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{target}}'\n"
        "generation_kwargs:\n  until: ['.']\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n",
    ),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo model with max_position_embeddings = WINDOW + 2, and the three task folders."""
    root = tmp_path_factory.mktemp("harness")
    model = root / "model"
    shutil.copytree(DEMO_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = WINDOW + 2
    (model / "config.json").write_text(json.dumps(config))
    tasks = root / "tasks"
    tasks.mkdir()
    for name, (docs, body) in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"{name}.yaml").write_text(_task_yaml(name, data, root / "datasets-cache", body))
    return root


@pytest.fixture
def vllm_alias() -> Iterator[None]:
    from batchgen import vllm_compat

    vllm_compat.install()
    try:
        yield
    finally:
        vllm_compat.uninstall()


def _evaluate(workspace: Path, model: str, model_args: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(workspace / "tasks")),
        log_samples=True,
        batch_size=4,
        device="cpu",
    )
    assert results is not None
    return {name: sorted(results["samples"][name], key=lambda s: s["doc_id"]) for name in TASKS}


def _loglikelihoods(samples: list[dict[str, Any]]) -> list[float]:
    """Every log-likelihood the task asked for, in doc and request order."""
    out: list[float] = []
    for sample in samples:
        for resp in sample["resps"]:
            value = resp[0]
            out.append(float(value[0] if isinstance(value, (list, tuple)) else value))
    return out


def test_lm_eval_vllm_backend_on_batchgen_matches_its_hf_backend(workspace: Path, vllm_alias: None) -> None:
    model = str(workspace / "model")
    ours = _evaluate(workspace, "vllm", {"pretrained": model, "dtype": "float32", "enforce_eager": True})
    theirs = _evaluate(workspace, "hf", {"pretrained": model, "dtype": "float32", "max_length": WINDOW})

    for name in ("bg_choice", "bg_rolling"):
        got, want = _loglikelihoods(ours[name]), _loglikelihoods(theirs[name])
        assert len(got) == len(want) > 0, name
        assert got == pytest.approx(want, abs=1e-4, rel=0), name
    # windows were cut: the longest text spans three (what makes the context length matter)
    from transformers import AutoTokenizer

    tokens = len(AutoTokenizer.from_pretrained(model)(PPL_DOCS[0]["text"])["input_ids"])
    assert tokens > 2 * WINDOW
    greedy = [[bool(r[0][1]) for r in s["resps"]] for s in ours["bg_choice"]]
    assert greedy == [[bool(r[0][1]) for r in s["resps"]] for s in theirs["bg_choice"]]

    texts = [s["resps"][0][0] for s in ours["bg_until"]]
    assert texts == [s["resps"][0][0] for s in theirs["bg_until"]]
    assert all(texts) and not any("." in t for t in texts)  # real continuations, cut at the stop string
