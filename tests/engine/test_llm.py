"""The public LLM API: prompts in, RequestOutputs out, in input order, with per-request errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from batchgen import LLM, RequestOutput, SamplingParams
from testkit.tiny_models import EOS_ID


@pytest.fixture(scope="module")
def llm(tiny_model: Callable[[str], Path]) -> LLM:
    return LLM(
        str(tiny_model("llama")),
        device="cpu",
        block_size=8,
        num_kv_blocks=32,
        max_num_batched_tokens=128,
        max_model_len=200,
    )


def test_string_prompts_and_single_params(llm: LLM) -> None:
    outputs = llm.generate(["w5 w6 w7", "w9"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [o.prompt_token_ids for o in outputs] == [[5, 6, 7], [9]]
    for out in outputs:
        sample = out.outputs[0]
        assert sample.finish_reason == "length" and len(sample.token_ids) == 4
        # the text continues the prompt's text (here: with its separating space)
        full = llm.tokenizer.decode(out.prompt_token_ids + sample.token_ids)
        assert sample.text == full[len(llm.tokenizer.decode(out.prompt_token_ids)) :]


def test_per_request_params_and_input_order(llm: LLM) -> None:
    prompts = [[2 + i] * (40 - 3 * i) for i in range(10)]  # decreasing lengths: finish order differs
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True) for i in range(10)]
    seen: list[RequestOutput] = []
    outputs = llm.generate(prompts, params, on_output=seen.append)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1 + i for i in range(10)]
    assert [o.request_id for o in outputs] == [str(i) for i in range(10)]
    assert sorted(id(o) for o in seen) == sorted(id(o) for o in outputs)


def test_request_that_can_never_fit_is_an_error_alone(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [[3] * 10, [4] * 300, [5] * 10, [], [7, 100_000]]
    outputs = llm.generate(prompts, params)
    ok, too_long, ok2, empty, bad_id = outputs
    for good in (ok, ok2):
        assert good.error is None and good.outputs[0].finish_reason in ("stop", "length") and good.outputs[0].token_ids
    assert too_long.error is not None and "exceeds max_model_len" in too_long.error
    assert too_long.outputs == [] and too_long.num_prompt_tokens == 300
    assert empty.error is not None and "empty" in empty.error
    assert bad_id.error is not None and "outside the vocabulary" in bad_id.error
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
    stop_id = probe.outputs[0].token_ids[1]
    out = llm.generate([[8, 9, 10]], SamplingParams(temperature=0.0, max_tokens=3, stop_token_ids=[stop_id]))[0]
    sample = out.outputs[0]
    assert sample.finish_reason == "stop" and sample.stop_reason == stop_id
    assert sample.token_ids == probe.outputs[0].token_ids[:2]
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
    with pytest.raises(TypeError, match="ambiguous"):
        llm.generate([2, 3])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unsupported key"):
        llm.generate({"prompt": "w2", "multi_modal_data": {}})
    with pytest.raises(ValueError, match=r"lora_request needs an engine built with LoRA: LLM\(model, enable_lora=True"):
        llm.generate("w2 w3", lora_request=object())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=2),  # sampled rows: the raw logits' own check
        SamplingParams(temperature=0.0, max_tokens=2),  # greedy: the check rides on the rows' maxima
        # greedy with EOS masked (min_tokens): the NaN sits in the masked column, where the masked
        # rows' maxima cannot see it
        SamplingParams(temperature=0.0, max_tokens=2, min_tokens=2),
    ],
    ids=["sampled", "greedy", "greedy-masked"],
)
def test_nan_logits_raise_instead_of_sampling_garbage(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, params: SamplingParams
) -> None:
    runner = llm.engine.runner
    real = runner._logits  # the forward's logits, before the draw
    column = min(llm.engine.eos_token_ids)

    def poisoned(chunks):  # type: ignore[no-untyped-def]
        logits, num_sampled = real(chunks)
        logits = logits.clone()
        logits[-1, column] = float("nan")  # one entry of the last row: the check must see any single NaN
        return logits, num_sampled

    with monkeypatch.context() as patch:
        patch.setattr(runner, "_logits", poisoned)
        with pytest.raises(RuntimeError, match="NaN logits"):
            llm.generate([[1, 2, 3], [4, 5]], params)
    # the same engine serves the next call, with nothing of the failed one left over
    assert not llm.engine.has_unfinished()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 2


def test_engine_is_reusable_after_a_failed_step(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect 7: a failed generate() left its requests queued and running, with their blocks and
    sampler state; the next generate() ran them too, and served the failed step's K/V from the cache."""
    llm = LLM(str(tiny_model("llama")), block_size=8, num_kv_blocks=32)
    prompts = [list(range(10, 30)), list(range(10, 26)) + [50, 51]]  # sharing two full blocks
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    runner, calls = llm.engine.runner, []
    real = runner.execute

    def dies_in_second_step(batch):  # type: ignore[no-untyped-def]
        calls.append(1)
        logits = real(batch)
        if len(calls) == 2:  # a step that died half-way through writing the pool
            for k, v in runner.kv_caches:
                k.fill_(float("nan"))
                v.fill_(float("nan"))
            raise RuntimeError("device lost")
        return logits

    seeded = SamplingParams(seed=3, max_tokens=30)
    with monkeypatch.context() as patch:
        patch.setattr(runner, "execute", dies_in_second_step)
        with pytest.raises(RuntimeError, match="device lost"):
            llm.generate(prompts + [[7] * 30], [params, params, seeded])
    engine = llm.engine
    assert not engine.has_unfinished() and engine.runner.batch.num_rows == 0 and not engine.requests
    assert engine.scheduler.block_manager.num_free_blocks == 32 and engine.scheduler.block_manager._tables == {}
    before, seen = llm.stats, []
    again = llm.generate(prompts, params, on_output=seen.append)
    assert [o.outputs[0].token_ids for o in again] == want  # no poisoned K/V served from the prefix cache
    assert llm.stats["output_tokens"] - before["output_tokens"] == 8 and len(seen) == 2  # no orphan ran


class _Stop(Exception):
    pass


def test_an_exception_from_on_output_leaves_no_orphans(llm: LLM) -> None:
    def stop(output: RequestOutput) -> None:
        raise _Stop

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 6, 12)]
    with pytest.raises(_Stop):  # raised when the first request finishes, two steps in
        llm.generate([[30] * 5, [31] * 40, [32] * 60], params, on_output=stop)
    assert not llm.engine.has_unfinished()
    outputs = llm.generate([[33] * 5], params[1])
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 6
    assert llm.engine.scheduler.block_manager.num_free_blocks == 32
