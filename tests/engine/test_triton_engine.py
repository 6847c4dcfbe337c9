"""engine.attention_backend: triton, end to end under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before triton's first import; with CUDA and the variable unset, compiled on the
GPU), and where the setting may pick it.

Greedy tokens must equal transformers' own generate: on a GQA model (llama, 2 query heads per KV
head), on Gemma 2 (sliding window on every other layer, logit soft-capping) and on GPT-NeoX (no
GQA), with chunked prefill (a 32-token step budget, so prefill chunks with cached context and
decodes share steps), prefix caching (a second request reuses the first one's blocks), and once
with the forward compiled around the attention op.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import SamplingParams, SettingError
from batchgen.engine.cpu import linear_calibration
from batchgen.engine.platforms import platform_for
from batchgen.engine.triton import support
from testkit.tiny_models import EOS_ID

PROMPTS = [[(5 * i + 3 * j) % 250 + 2 for j in range(n)] for i, n in enumerate((45, 18, 3))]
LATER = PROMPTS[0][:36] + [7, 9, 11]  # its first two blocks are the first prompt's: cached
MAX_TOKENS = 4
needs_triton = pytest.mark.skipif(
    not support.triton_importable() or not (support.interpreting() or torch.cuda.is_available()),
    reason="triton is not installed (Linux only), or neither its interpreter nor CUDA is here",
)
DEVICE = "cpu" if support.interpreting() else "cuda"
SETTINGS = dict(device=DEVICE, dtype="float32", num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=8)


def _transformers_tokens(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                eos_token_id=EOS_ID,
                pad_token_id=EOS_ID,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _check(arch: str, compile: bool, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> LLM:
    # the linears on torch's BLAS whatever this machine's calibration chose (as test_parity's eager runs)
    monkeypatch.setattr(linear_calibration, "masks", lambda groups, kernel, library: dict.fromkeys(groups, 0))
    path = tiny_model(arch)
    llm = LLM(str(path), attention_backend="triton", compile=compile, **SETTINGS)  # type: ignore[arg-type]
    assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.block_size == 16
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    got += [o.outputs[0].token_ids for o in llm.generate([LATER], params)]
    assert got == _transformers_tokens(path, PROMPTS + [LATER])
    assert llm.stats["cached_tokens"] >= 32, llm.stats
    return llm


@needs_triton
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_neox"])
def test_greedy_tokens_match_transformers(
    arch: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _check(arch, False, tiny_model, monkeypatch)


@needs_triton
def test_greedy_tokens_match_transformers_compiled(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = _check("gemma2", True, tiny_model, monkeypatch)
    assert llm.engine.runner.forward.stats.graphs >= 1  # it really compiled


@needs_triton
def test_triton_runs_on_the_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"'triton' runs on CUDA; on the CPU only .*TRITON_INTERPRET=1"):
        platform_for(cpu).attention_backend("triton")
    with pytest.raises(ValueError, match="runs on CUDA, not on mps"):
        platform_for(torch.device("mps")).attention_backend("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert platform_for(cpu).attention_backend("triton") == "triton"
    assert platform_for(cpu).attention_backend("auto") == "cpu"  # auto never interprets
    with pytest.raises(ValueError, match="auto, torch, cpu, triton"):
        platform_for(cpu).attention_backend("flash")


def test_auto_picks_triton_on_an_ampere_or_newer_gpu_where_it_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(support, "triton_importable", lambda: True)
    assert platform_for(cuda).attention_backend("auto") == "triton"
    capability[0] = (7, 5)
    assert platform_for(cuda).attention_backend("auto") == "torch"
    capability[0] = (8, 0)
    monkeypatch.setattr(support, "triton_importable", lambda: False)
    assert platform_for(cuda).attention_backend("auto") == "torch"
    with pytest.raises(ValueError, match=r"pip install 'batchgen\[cuda\]'"):
        platform_for(cuda).attention_backend("triton")


def test_the_setting_accepts_triton_and_names_it_when_wrong() -> None:
    assert EngineConfig(attention_backend="triton").attention_backend == "triton"
    with pytest.raises(SettingError, match="'auto', 'torch', 'cpu' or 'triton'"):
        EngineConfig(attention_backend="flash")  # type: ignore[arg-type]
