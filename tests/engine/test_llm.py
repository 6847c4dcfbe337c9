"""The public LLM API: prompts in, RequestOutputs out, in input order, with per-request errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM, RequestOutput, SamplingParams

from .conftest import EOS_ID


@pytest.fixture(scope="module")
def llm(tiny_model: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model("llama")), device="cpu", block_size=8, num_kv_blocks=32, max_num_batched_tokens=128,
               max_model_len=200)


def test_string_prompts_and_single_params(llm: LLM) -> None:
    outputs = llm.generate(["w5 w6 w7", "w9"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == [[5, 6, 7], [9]]
    for out in outputs:
        assert out.finish_reason == "length" and len(out.token_ids) == 4
        # the text continues the prompt's text (here: with its separating space)
        full = llm.tokenizer.decode(out.prompt_token_ids + out.token_ids)
        assert out.text == full[len(llm.tokenizer.decode(out.prompt_token_ids)):]


def test_per_request_params_and_input_order(llm: LLM) -> None:
    prompts = [[2 + i] * (40 - 3 * i) for i in range(10)]  # decreasing lengths: finish order differs
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True) for i in range(10)]
    seen: list[RequestOutput] = []
    outputs = llm.generate(prompts, params, on_output=seen.append)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.token_ids) for o in outputs] == [1 + i for i in range(10)]
    assert [o.request_id for o in outputs] == list(range(10))
    assert sorted(id(o) for o in seen) == sorted(id(o) for o in outputs)


def test_request_that_can_never_fit_is_an_error_alone(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [[3] * 10, [4] * 300, [5] * 10, [], [7, 100_000]]
    outputs = llm.generate(prompts, params)
    ok, too_long, ok2, empty, bad_id = outputs
    for good in (ok, ok2):
        assert good.error is None and good.finish_reason in ("stop", "length") and good.token_ids
    assert too_long.finish_reason == "error" and "exceeds max_model_len" in too_long.error
    assert too_long.token_ids == [] and too_long.num_prompt_tokens == 300
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert bad_id.finish_reason == "error" and "outside the vocabulary" in bad_id.error
    assert llm.max_model_len == 200


def test_shared_prefix_is_served_from_the_cache(llm: LLM) -> None:
    prefix = list(range(10, 42))  # 4 full blocks
    first = llm.generate([prefix + [50]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    second = llm.generate([prefix + [60, 61]], SamplingParams(temperature=0.0, max_tokens=2))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 32
    assert llm.stats["cached_tokens"] >= 32


def test_eos_and_stop_token_ids_finish_with_stop(llm: LLM) -> None:
    probe = llm.generate([[8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    stop_id = probe.token_ids[1]
    out = llm.generate([[8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == probe.token_ids[:2]
    assert EOS_ID in llm.engine.eos_token_ids


def test_stats_count_the_work(llm: LLM) -> None:
    before = dict(llm.stats)
    llm.generate([[20] * 20], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    after = llm.stats
    assert after["output_tokens"] - before["output_tokens"] == 5
    assert after["decode_tokens"] - before["decode_tokens"] == 4  # the last token is never run
    assert after["prefill_tokens"] - before["prefill_tokens"] + after["cached_tokens"] - before["cached_tokens"] == 20
    assert after["steps"] > before["steps"]


def test_bad_arguments_raise(llm: LLM) -> None:
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError):
        llm.generate("w2 w3")  # type: ignore[arg-type]


def test_nan_logits_raise_instead_of_sampling_garbage(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = LLM(str(tiny_model("llama")), num_kv_blocks=32)  # why fresh: the failed step leaves state behind
    runner = fresh.engine.runner
    real = runner.execute

    def poisoned(batch):  # type: ignore[no-untyped-def]
        logits = real(batch)
        return torch.full_like(logits, float("nan"))

    monkeypatch.setattr(runner, "execute", poisoned)
    with pytest.raises(RuntimeError, match="NaN logits"):
        fresh.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
