"""The engine in bf16 against transformers in bf16 on every parity architecture, under the reduced-
precision policy (testkit/precision_policy): teacher-forced prompt logprobs agree at clear
positions, greedy tokens agree up to transformers' own first near-tie. The float32 parity tests
(test_parity) stay token-exact and pin float32."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.outputs import Logprob
from batchgen.engine.api.params import SamplingParams
from testkit import precision_policy as policy
from testkit.tiny_models import EOS_ID, VOCAB

from .conftest import ARCHITECTURES

log = logging.getLogger(__name__)
MAX_TOKENS = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(46)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (5, 17, 40, 64, 100, 150, 33, 8)]


PROMPTS = _prompts()
_REFERENCE: dict[str, policy.Reference] = {}
_SAVED: dict[str, Path] = {}


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_bf16_engine_meets_the_reduced_precision_policy(
    arch: str, backend: str, tiny_model: Callable[[str], Path]
) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_model(arch)
    ref = policy.reference(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval(), PROMPTS, MAX_TOKENS, EOS_ID
    )
    llm = LLM(str(path), device="cpu", dtype="bfloat16", attention_backend=backend, compile=False, block_size=16)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1))
    verdict = policy.judge(ref, PROMPTS, outputs)
    log.info("%s/%s %s\n%s", arch, backend, verdict["prompt"], "\n".join(verdict["greedy"]))
    assert verdict["clear_positions"] >= 50, verdict[
        "prompt"
    ]  # the check has teeth (Gemma 2's soft-capping flattens most)
    assert verdict["ok"], f"{arch}/{backend}: {verdict['failures']}"


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_every_measured_decode_path_meets_the_policy(
    arch: str, path: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whichever decode path cpu/backend.native_wins measures faster here (the native kernel's bf16
    twin over decode rows, or the torch backend's gathered blocks), the other is right too (a machine
    elsewhere takes it): the measurement is replaced by each answer in turn."""
    from transformers import AutoModelForCausalLM

    from batchgen.engine.cpu import backend

    monkeypatch.setattr(backend, "native_wins", lambda *shape: path == "native")
    model_path = tiny_model(arch)
    if arch not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        _REFERENCE[arch] = policy.reference(model, PROMPTS, MAX_TOKENS, EOS_ID)
    llm = LLM(str(model_path), device="cpu", dtype="bfloat16", attention_backend="cpu", compile=False, block_size=16)
    assert llm.engine.runner.backend.name == ("cpu" if path == "native" else "torch")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1))
    verdict = policy.judge(_REFERENCE[arch], PROMPTS, outputs)
    assert verdict["ok"], f"{arch}/{path}: {verdict['failures']}"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bf16_linears_on_the_native_twin_meet_the_policy(
    arch: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the calibration measures here, a machine elsewhere may route every bf16 linear through
    the kernel's bf16 twin (csrc/skinny_linear_bf16.c) at every row count: that is right too (qwen2:
    with biases)."""
    from transformers import AutoModelForCausalLM

    from batchgen.engine.cpu import linear_calibration, native_linear, packed_linear

    monkeypatch.setattr(
        linear_calibration, "masks", lambda groups, *_: dict.fromkeys(groups, native_linear.EVERY_BUCKET)
    )
    monkeypatch.setattr(packed_linear, "choices", lambda groups, *_: dict.fromkeys(groups, False))
    model_path = tiny_model(arch)
    if arch not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        _REFERENCE[arch] = policy.reference(model, PROMPTS, MAX_TOKENS, EOS_ID)
    llm = LLM(str(model_path), device="cpu", dtype="bfloat16", attention_backend="cpu", compile=False, block_size=16)
    routed = [m for m in llm.engine.runner.model.modules() if isinstance(m, native_linear.NativeLinear)]
    assert routed and all(m.weight.dtype == torch.bfloat16 for m in routed)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1))
    verdict = policy.judge(_REFERENCE[arch], PROMPTS, outputs)
    assert verdict["ok"], f"{arch}/native linears: {verdict['failures']}"


@pytest.mark.parametrize("compile", [False, True])
def test_a_tied_head_packed_with_its_embedding_meets_the_policy(
    compile: bool, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tied LM head is packed too, and its embedding gathers each token's row from the packed
    bytes (packed_linear.PackedEmbedding): eager, and as part of the compiled forward."""
    from transformers import AutoModelForCausalLM

    from batchgen.engine.cpu import native, packed_linear
    from testkit.tiny_models import save_random_model, tiny_configs

    if native.vnni_linear() is None:
        pytest.skip("no AVX512-BF16 build here: nothing is packed (test_packed_linear checks that)")
    monkeypatch.setattr(packed_linear, "choices", lambda groups, *_: dict.fromkeys(groups, True))
    if "tied-llama" not in _REFERENCE:
        config = tiny_configs()["llama"]
        config.tie_word_embeddings = True
        _SAVED["tied-llama"] = save_random_model(config, tmp_path_factory.mktemp("tied-llama"))
        model = AutoModelForCausalLM.from_pretrained(_SAVED["tied-llama"], dtype=torch.bfloat16).eval()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        _REFERENCE["tied-llama"] = policy.reference(model, PROMPTS, MAX_TOKENS, EOS_ID)
    llm = LLM(
        str(_SAVED["tied-llama"]),
        device="cpu",
        dtype="bfloat16",
        attention_backend="cpu",
        compile=compile,
        block_size=16,
    )
    model = llm.engine.runner.model
    assert isinstance(model.model.embed_tokens, packed_linear.PackedEmbedding)
    assert model.model.embed_tokens.packed is model.lm_head.packed
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1))
    verdict = policy.judge(_REFERENCE["tied-llama"], PROMPTS, outputs)
    assert verdict["ok"], f"tied llama/packed head: {verdict['failures']}"


@pytest.mark.parametrize(("arch", "compile"), [("llama", False), ("qwen2", False), ("llama", True)])
def test_bf16_linears_on_packed_weights_meet_the_policy(
    arch: str, compile: bool, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where AVX512-BF16 is built, a machine may pack every bf16 linear's weight (csrc/vnni_linear_bf16.c)
    and run every row count through it, eager or as a node of the compiled forward (qwen2: with biases)."""
    from transformers import AutoModelForCausalLM

    from batchgen.engine.cpu import native, packed_linear

    if native.vnni_linear() is None:
        pytest.skip("no AVX512-BF16 build here: nothing is packed (test_packed_linear checks that)")
    monkeypatch.setattr(packed_linear, "choices", lambda groups, *_: dict.fromkeys(groups, True))
    model_path = tiny_model(arch)
    if arch not in _REFERENCE:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16).eval()
        _REFERENCE[arch] = policy.reference(model, PROMPTS, MAX_TOKENS, EOS_ID)
    llm = LLM(str(model_path), device="cpu", dtype="bfloat16", attention_backend="cpu", compile=compile, block_size=16)
    packed = [m for m in llm.engine.runner.model.modules() if isinstance(m, packed_linear.PackedLinear)]
    assert packed and llm.native_linears >= len(packed)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1))
    verdict = policy.judge(_REFERENCE[arch], PROMPTS, outputs)
    assert verdict["ok"], f"{arch}/packed linears: {verdict['failures']}"


def test_lora_on_packed_bf16_linears_meets_the_policy(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter's update rides on a packed layer (PackedLinear has no `weight`): rows with the
    adapter meet the bf16 policy against peft's model in bf16, rows without it the base's. Why peft
    unmerged: in bf16, W + BA rounded once (a merged model) is not what any unmerged engine computes,
    and differed from ours before a near-tie on one prompt, packed or not."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from batchgen import LoRARequest
    from batchgen.engine.cpu import native, packed_linear
    from testkit.tiny_lora import save_tiny_adapter

    if native.vnni_linear() is None:
        pytest.skip("no AVX512-BF16 build here: nothing is packed (test_packed_linear checks that)")
    monkeypatch.setattr(packed_linear, "choices", lambda groups, *_: dict.fromkeys(groups, True))
    base = tiny_model("llama")
    adapter = save_tiny_adapter(base, tmp_path / "a", r=8, target_modules=("q_proj", "v_proj", "down_proj"))
    llm = LLM(str(base), device="cpu", dtype="bfloat16", enable_lora=True, max_loras=1, max_lora_rank=8)
    assert any(isinstance(m, packed_linear.PackedLinear) for m in llm.engine.runner.model.modules())
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=1)
    base_ref = policy.reference(model, PROMPTS, MAX_TOKENS, EOS_ID)
    adapter_ref = policy.reference(PeftModel.from_pretrained(model, adapter).eval(), PROMPTS, MAX_TOKENS, EOS_ID)
    for request, ref in ((LoRARequest("a", 1, str(adapter)), adapter_ref), (None, base_ref)):
        verdict = policy.judge(ref, PROMPTS, llm.generate(PROMPTS, params, lora_request=request))
        assert verdict["ok"], f"adapter {request}: {verdict['failures']}"


def test_the_policy_fails_a_divergence_before_any_near_tie_and_a_wrong_top1() -> None:
    assert not policy.check_greedy([5, 6, 9], [5, 6, 7], [2.0, 2.0, 2.0, 0.01]).ok
    assert policy.check_greedy([5, 6, 9], [5, 6, 7], [2.0, 0.05, 2.0]).ok  # the tie at 1 came first
    assert not policy.check_greedy([5], [5, 6], [2.0, 2.0]).ok  # stopped early with no near-tie
    logits = torch.tensor([[4.0, 0.0, 0.0], [0.0, 4.0, 0.0]])  # clear positions: top-1 is 0, then 1
    wrong = [None, {1: Logprob(-0.04, 1)}, {2: Logprob(-4.0, 2), 0: Logprob(-0.04, 1)}]  # top-1 1 then 0: both wrong
    verdict = policy.check_prompt_logprobs([logits], [[0, 1, 2]], [wrong])
    assert verdict.clear == 2 and verdict.top1_agree == 0 and not verdict.ok
