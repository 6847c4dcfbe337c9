"""Shared fixtures: a tiny random-weight Llama with a locally trained byte-level BPE tokenizer,
and helpers to write Parquet inputs and job files. Nothing is downloaded."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import yaml


def _interpret_triton() -> None:
    """Triton's interpreter for the triton attention backend's tests (tests/engine/test_triton_*.py),
    on a machine without CUDA (with CUDA they run the compiled kernels on the GPU), unless the
    environment says otherwise.

    Why here, first: triton fixes compiled-or-interpreted when it is first imported (triton.language's
    own functions are decorated then), and importing transformers' model classes imports it, so the
    variable must be set before any test module is imported; the root conftest is the earliest place
    (importing torch does not import triton). Why for the whole session rather than a subprocess per
    test: nothing else runs Triton kernels on the CPU (inductor's CPU backend generates C++), and a
    subprocess would pay a torch + transformers import per run and hide tracebacks. The tests of the
    refusal without it delete it (monkeypatch)."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton()
# moto's request recorder (when a request turns it on) writes `moto_recording` into the working folder,
# the checkout; it reads where once, as moto is first imported, so this is set before any test module
os.environ.setdefault("MOTO_RECORDER_FILEPATH", os.path.join(tempfile.gettempdir(), "batchgen-tests-moto-recording"))


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "once upon a time there was a little cat who liked to play in the sun with her friend dog".split()


def build_tokenizer(vocab_size: int = 400) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    lines = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) + "." for i in range(200)]
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama (GQA) with random weights, saved with its tokenizer like a real HF folder."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), build_tokenizer())


def save_tiny_llama(path: Path, tokenizer: Any) -> Path:
    """Save a 2-layer GQA Llama with random weights (seed 0) sized for `tokenizer`, and the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        initializer_range=0.2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_parquet(path: Path, columns: dict[str, list[Any]], schema: pa.Schema | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def write_job(path: Path, job: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def make_job(model: Path, inputs: str, out: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    job: dict[str, Any] = {
        "model": {"path": str(model)},
        "input": {"path": inputs, "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(out)},
        "sampling": {"max_tokens": 8},
        "engine": {"backend": "hf", "window_rows": 16},
    }
    for name, values in sections.items():
        job[name].update(values)
    return job


def output_table(out: Path, columns: list[str] | None = None) -> pa.Table:
    """An output folder's rows in input order (README, "The output": parts follow the prefix plan,
    `input_row` gives input order back; an output without it is in input order already)."""
    table = ds.dataset(out, format="parquet").to_table()
    if "input_row" in table.column_names:
        table = table.sort_by("input_row")
    return table if columns is None else table.select(columns)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules holding `slow` tests first, each module's tests kept together and in their order.

    Why: `make test`'s two xdist workers take tests in collection order, and alphabetical order put
    several of the longest end-to-end modules (tensor parallel jobs, the wheel in a fresh venv)
    last, where one worker could run them alone while the other had nothing left. Long tests
    first and short ones last lets the two finish together. Whole modules move, so a module's
    fixtures are still set up once per worker."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each side is kept
