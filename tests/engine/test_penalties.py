"""Penalties, biases, bad words and allowed ids: greedy tokens equal transformers' generate with the
same processors (its own for repetition_penalty, bad_words_ids and sequence_bias; an OpenAI-formula
LogitsProcessor for presence/frequency), in one engine batch that mixes rows with and without them."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from testkit.tiny_models import EOS_ID, VOCAB

MAX_TOKENS = 24


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(2, 40) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


class _OpenAIPenalties(LogitsProcessor):
    """Reference: logit -= frequency * count + presence * (count > 0), counts over generated tokens."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len :], minlength=scores.shape[1]).float()
            scores[b] -= self.frequency * counts + self.presence * (counts > 0).float()
        return scores


def _reference(model: Any, prompt: list[int], **kwargs: Any) -> list[int]:
    ids = torch.tensor([prompt])
    processors = kwargs.pop("processor", None)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=EOS_ID,
            pad_token_id=EOS_ID,
            logits_processor=LogitsProcessorList([processors(len(prompt))]) if processors else None,
            **kwargs,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def llama(tiny_model: Callable[[str], Path]) -> tuple[LLM, Any]:
    path = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LLM(str(path), device="cpu", dtype="float32", max_num_seqs=16), model


# each case: (our SamplingParams fields, transformers generate kwargs for the same processing)
CASES: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"repetition_penalty": 0.7}, {"repetition_penalty": 0.7}),
    (
        {"bad_words": ["w5", "w7 w9"], "logit_bias": {11: 4.0, 12: -2.5}},
        {"bad_words_ids": [[5], [7, 9]], "sequence_bias": {(11,): 4.0, (12,): -2.5}},
    ),
    (
        {"presence_penalty": 1.5, "frequency_penalty": 0.8},
        {"processor": lambda n: _OpenAIPenalties(n, presence=1.5, frequency=0.8)},
    ),
    (
        {"repetition_penalty": 1.3, "frequency_penalty": -0.5, "logit_bias": {20: 3.0}},
        {
            "repetition_penalty": 1.3,
            "sequence_bias": {(20,): 3.0},
            "processor": lambda n: _OpenAIPenalties(n, presence=0.0, frequency=-0.5),
        },
    ),
]


def test_greedy_features_match_transformers_in_one_mixed_batch(llama: tuple[LLM, Any]) -> None:
    llm, model = llama
    prompts = _prompts()
    plain = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    unpenalized = [_reference(model, prompt) for prompt in prompts]
    batch_prompts, batch_params, expected = [], [], []
    for ours, theirs in CASES:
        for prompt, reference in zip(prompts, unpenalized):
            batch_prompts += [prompt, prompt]  # each featured row next to a plain one: per-row vectorization
            batch_params += [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, **ours), plain]
            expected += [_reference(model, prompt, **dict(theirs)), reference]
    got = [o.outputs[0].token_ids for o in llm.generate(batch_prompts, batch_params)]
    assert got == expected
    # the features change the output (else this test could not fail)
    assert sum(got[i] != got[i + 1] for i in range(0, len(got), 2)) >= len(CASES) * 2


def test_bad_words_are_never_generated_where_greedy_would_pick_them(llama: tuple[LLM, Any]) -> None:
    llm, _ = llama
    prompts = _prompts()
    free = [o.outputs[0] for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))]
    favourite = max({t for o in free for t in o.token_ids} - {EOS_ID})
    # a two-token word: the pair (a, b) greedy made somewhere must not appear any more
    pair = next((o.token_ids[i], o.token_ids[i + 1]) for o in free for i in range(len(o.token_ids) - 1))
    words = [f"w{favourite}", f"w{pair[0]} w{pair[1]}"]
    banned = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, bad_words=words)
    for out in (o.outputs[0] for o in llm.generate(prompts, banned)):
        assert favourite not in out.token_ids
        assert all(tuple(out.token_ids[i : i + 2]) != pair for i in range(len(out.token_ids) - 1))


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_allowed_token_ids_bound_every_token(llama: tuple[LLM, Any], temperature: float) -> None:
    llm, _ = llama
    allowed = [3, 17, 42, 99]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=3, allowed_token_ids=allowed)
    outs = [o.outputs[0] for o in llm.generate(_prompts(), params)]
    tokens = {t for o in outs for t in o.token_ids}
    assert tokens <= set(allowed)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs)  # EOS is not allowed either


def test_an_out_of_vocabulary_bias_is_an_error_output_not_a_crash(llama: tuple[LLM, Any]) -> None:
    llm, _ = llama
    bad = SamplingParams(max_tokens=4, logit_bias={VOCAB + 5: 1.0})
    out = llm.generate(_prompts(2), [bad, SamplingParams(max_tokens=4)])
    assert not out[0].outputs and "outside the vocabulary" in (out[0].error or "")
    assert out[1].error is None and out[1].outputs[0].finish_reason in ("stop", "length")
    assert llm.engine.runner.batch.num_rows == 0  # the refused request never got a row; the other finished


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("logit_bias", {1: 101.0}),
        ("bad_words", [""]),
        ("allowed_token_ids", []),
    ],
)
def test_bad_values_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})


class _Ops(TorchDispatchMode):
    """Every aten op called while active (name, accumulate flag of index_put_)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        accumulate = "index_put" in str(func) and ((len(args) > 3 and args[3]) or (kwargs or {}).get("accumulate"))
        self.ops.append(f"{func}{' accumulate' if accumulate else ''}")
        return func(*args, **(kwargs or {}))


def test_the_sampling_step_makes_no_host_scalar_tensor(llama: tuple[LLM, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`t[idx] = 0.5` (a Python number) makes a CPU scalar tensor that torch copies to a CUDA target
    with a blocking copy, a sync on every call; index_put_(accumulate=True) sorts its indices. The
    first H200 run's profiler found one such sync per decode step with penalties. On the CPU the
    copy is free, so this checks the cause: no aten.scalar_tensor and no accumulating index_put_
    in the sampler's step or the penalty rows' set-up, with every feature on."""
    from batchgen.engine.sampling import penalties
    from batchgen.engine.sampling.sampler import Sampler

    llm, _ = llama
    seen = _Ops()
    for owner, name in ((Sampler, "sample"), (penalties.PenaltyTables, "take")):
        original = getattr(owner, name)

        def recorded(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            with seen:
                return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)
    params = SamplingParams(
        max_tokens=6, temperature=0.0, min_tokens=3, repetition_penalty=1.3, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={11: 2.0}, bad_words=["w5"], allowed_token_ids=list(range(2, 60)),
    )  # fmt: skip
    llm.generate(_prompts(3), params)
    assert any("aten.where" in op for op in seen.ops)  # the recording saw the penalties at work
    bad = [op for op in seen.ops if "scalar_tensor" in op or op.endswith("accumulate")]
    assert not bad, bad
