"""Greedy parity: the engine's tokens equal transformers' own generate, token for token.

For every supported architecture, 37 prompts (1 to 300 tokens, shared long prefixes, duplicates)
run through the engine twice — under pressure (prefix caching on, a 64-token step budget that
forces chunked prefill, a KV pool small enough to force preemption) and relaxed (prefix caching
off, big budget, another block size) — and must match `generate(do_sample=False)` run per prompt,
unpadded, on the same float32 weights, with either decode K/V source (contiguous rows, gathered
blocks). Refused architectures raise a clear error at load.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.cpu import linear_calibration, native_linear
from batchgen.engine.runner.models import UnsupportedModelError, resolve_max_model_len
from testkit.tiny_models import EOS_ID, MAX_POS, VOCAB, save_random_model

from .conftest import ARCHITECTURES

PRESSURE = dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=24, enable_prefix_caching=True)
RELAXED = dict(block_size=8, max_num_batched_tokens=1024, max_num_seqs=64, enable_prefix_caching=False)


def _prompts() -> tuple[list[list[int]], list[int]]:
    """Prompts of mixed lengths, some sharing 96- and 200-token prefixes, and their max_tokens.

    The first eight (3 blocks each, 24 new tokens) are admitted together and outgrow the
    24-block pool while decoding, which forces preemption.
    """
    rng = random.Random(1234)

    def words(n: int) -> list[int]:
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    short_prefix, long_prefix = words(96), words(200)
    prompts = [words(48 - i % 2) for i in range(8)]
    prompts += [words(n) for n in (1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 100, 128, 180, 250, 300)]
    prompts += [short_prefix + words(n) for n in (0, 1, 5, 16, 23, 40, 61)]
    prompts += [long_prefix + words(n) for n in (0, 7, 16, 50, 90)]
    prompts += [prompts[11], prompts[25]]  # exact duplicates
    max_tokens = [24] * 8 + [rng.randrange(1, 13) for _ in prompts[8:]]
    return prompts, max_tokens


PROMPTS, MAX_TOKENS = _prompts()
_REFERENCE: dict[str, list[list[int]]] = {}


def _reference(arch: str, path: Path) -> list[list[int]]:
    """transformers' greedy generate, one unpadded prompt at a time (its default attention)."""
    if arch not in _REFERENCE:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        outputs = []
        with torch.inference_mode():
            for prompt, max_tokens in zip(PROMPTS, MAX_TOKENS):
                ids = torch.tensor([prompt])
                out = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_tokens,
                    eos_token_id=EOS_ID,
                    pad_token_id=EOS_ID,
                )
                outputs.append(out[0, len(prompt) :].tolist())
        _REFERENCE[arch] = outputs
    return _REFERENCE[arch]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("setting", ["pressure", "relaxed"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity(
    arch: str, setting: str, backend: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eager, with the linears on torch's BLAS on every host (whatever this machine's calibration
    chose; the native-linear tests below pin the kernels in)."""
    _pin_linears(monkeypatch, 0)
    llm = _check_parity(arch, setting, backend, False, tiny_model)
    assert llm.native_linears == 0


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_parity_compiled(arch: str, tiny_model: Callable[[str], Path]) -> None:
    """engine.compile on (torch.compile around the attention op, tokens padded): the same tokens.

    Under pressure (chunked prefill, prefix caching, preemption), with decode rows (the CPU default).
    """
    llm = _check_parity(arch, "pressure", "cpu", True, tiny_model)
    stats = llm.engine.runner.forward.stats
    assert stats.graphs >= 1 and stats.seconds > 0, stats  # it really compiled


# gpt2's projections are transformers' Conv1D, not nn.Linear: nothing to route
NATIVE_LINEAR_ARCHS = [a for a in ARCHITECTURES if a != "gpt2"]
# row-bucket masks: the kernels at decode sizes (up to 64 rows), and at every size
DECODE_SIZES = (1 << 7) - 1
EVERY_SIZE = native_linear.EVERY_BUCKET


def _pin_linears(monkeypatch: pytest.MonkeyPatch, mask: int) -> None:
    """Every linear shape gets `mask`, whatever this machine's calibration would choose."""
    monkeypatch.setattr(linear_calibration, "masks", lambda groups, kernel, library: dict.fromkeys(groups, mask))


@pytest.mark.parametrize("arch", NATIVE_LINEAR_ARCHS)
def test_greedy_parity_native_linears(
    arch: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every linear layer through the native kernels at decode sizes: the same tokens, eager under
    pressure (its 64-token steps: every prefill chunk through them too)."""
    _pin_linears(monkeypatch, DECODE_SIZES)
    llm = _check_parity(arch, "pressure", "cpu", False, tiny_model)
    assert llm.native_linears > 0


@pytest.mark.parametrize("arch", NATIVE_LINEAR_ARCHS)
def test_greedy_parity_native_linears_at_every_size(
    arch: str, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernels at every size (where a machine measured them faster everywhere), prefill chunks of
    up to 1,024 tokens included (relaxed)."""
    _pin_linears(monkeypatch, EVERY_SIZE)
    llm = _check_parity(arch, "relaxed", "cpu", False, tiny_model)
    assert llm.native_linears > 0


@pytest.mark.parametrize("mask", [DECODE_SIZES, EVERY_SIZE], ids=["decode", "every"])
def test_greedy_parity_native_linears_compiled(
    mask: int, tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with the forward compiled (the CPU default), the operator a node of the graph."""
    _pin_linears(monkeypatch, mask)
    llm = _check_parity("llama", "pressure", "cpu", True, tiny_model)
    assert llm.native_linears > 0 and llm.engine.runner.forward.stats.graphs >= 1


def _check_parity(arch: str, setting: str, backend: str, compile: bool, tiny_model: Callable[[str], Path]) -> LLM:
    path = tiny_model(arch)
    expected = _reference(arch, path)
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        attention_backend=backend,
        compile=compile,
        **(PRESSURE if setting == "pressure" else RELAXED),
    )
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in MAX_TOKENS]
    outputs = llm.generate(PROMPTS, params)
    for i, (out, want) in enumerate(zip(outputs, expected)):
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == want, f"{arch}/{setting} prompt {i} ({len(PROMPTS[i])} tokens)"
        assert out.outputs[0].finish_reason == ("stop" if want[-1] == EOS_ID else "length")
    stats = llm.stats
    if setting == "pressure":
        assert stats["preemptions"] > 0, stats
        assert stats["cached_tokens"] > 0, stats
        assert stats["steps"] > sum(map(len, PROMPTS)) // PRESSURE["max_num_batched_tokens"]  # chunked
    else:
        assert stats["cached_tokens"] == 0, stats
    return llm


def _refused(tmp_path: Path, config: object) -> str:
    with pytest.raises(UnsupportedModelError) as info:
        LLM(str(save_random_model(config, tmp_path)), device="cpu")
    return str(info.value)


def test_model_without_attention_interface_is_refused(tmp_path: Path) -> None:
    from transformers import BloomConfig

    config = BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    assert "attention interface" in _refused(tmp_path, config)


def test_attention_sinks_are_refused(tmp_path: Path) -> None:
    from transformers import GptOssConfig

    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        max_position_embeddings=MAX_POS,
        layer_types=["sliding_attention", "full_attention"],
    )
    assert "attention sinks" in _refused(tmp_path, config)


def test_long_rope_past_its_switch_is_refused() -> None:
    from transformers import Phi3Config

    factors = [1.0] * 8
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=1024,
        original_max_position_embeddings=256,
        rope_parameters={
            "rope_type": "longrope",
            "short_factor": factors,
            "long_factor": factors,
            "original_max_position_embeddings": 256,
        },
    )
    with pytest.raises(UnsupportedModelError, match="LongRoPE"):
        resolve_max_model_len(config, None)
    assert resolve_max_model_len(config, 256) == 256
