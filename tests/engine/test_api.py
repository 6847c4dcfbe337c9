"""The vLLM-shaped surface of LLM: prompt forms, `chat`, and the RequestOutput / CompletionOutput fields."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchgen import LLM, CompletionOutput, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), device="cpu", block_size=8, num_kv_blocks=64)


def test_prompt_forms_give_the_same_request(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = list(llm.tokenizer("once upon a time")["input_ids"])
    outs = [
        *llm.generate("once upon a time", params),
        *llm.generate({"prompt": "once upon a time"}, params),
        *llm.generate([{"prompt_token_ids": ids}, ids], params),
    ]
    assert all(isinstance(o, RequestOutput) and o.prompt_token_ids == ids for o in outs)
    assert [o.prompt for o in outs] == ["once upon a time", "once upon a time", None, None]
    assert [o.request_id for o in outs] == ["0", "0", "0", "1"]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    sample = outs[0].outputs[0]
    assert isinstance(sample, CompletionOutput) and sample.index == 0 and sample.finished()
    assert sample.logprobs is None and sample.cumulative_logprob is None and outs[0].prompt_logprobs is None


def test_chat_applies_the_template(llm: LLM) -> None:
    conversation = [{"role": "user", "content": "the cat"}]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    one = llm.chat(conversation, params)
    two = llm.chat([conversation, [{"role": "user", "content": "a dog"}]], params)
    want = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    if not isinstance(want, list):  # transformers versions differ: a BatchEncoding or the ids
        want = want["input_ids"]
    assert one[0].prompt_token_ids == list(want) == two[0].prompt_token_ids
    assert one[0].prompt is not None and one[0].prompt.endswith("<|assistant|>")
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids and len(two) == 2


def test_unknown_vllm_arguments_are_refused(llm: LLM) -> None:
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)  # type: ignore[call-arg]
