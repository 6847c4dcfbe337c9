"""logprobs and prompt_logprobs against transformers: log_softmax of transformers' own logits.

Greedy logprobs must match `compute_transition_scores` of transformers' greedy generate (over its
raw `output_logits`) within 1e-4 (float32); sampled tokens' logprobs are of the raw distribution (before temperature and
filters), so they must match log_softmax of transformers' forward over prompt + output.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams

PROMPTS = [[5 + (i * 11) % 240 for i in range(n)] for n in (3, 21, 40)]
TOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    # a 16-token step budget: the 40-token prompt's prefill is chunked over several steps
    return LLM(
        str(model_dir), device="cpu", block_size=8, num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=200
    )


def raw_logprobs(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: log_softmax of transformers' logits at every position (independent of us)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_greedy_logprobs_match_compute_transition_scores(llm: LLM, hf: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        gen = hf.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=8,
            min_new_tokens=8,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
        # why gen.logits: output_scores are processed (min_new_tokens masks EOS); logprobs are raw
        scores = hf.compute_transition_scores(gen.sequences, gen.logits, normalize_logits=True)[0]
        sample = out.outputs[0]
        assert sample.token_ids == gen.sequences[0, len(prompt) :].tolist()
        assert sample.logprobs is not None and len(sample.logprobs) == 8
        mine = [entry[t].logprob for t, entry in zip(sample.token_ids, sample.logprobs)]
        assert torch.allclose(torch.tensor(mine), scores.float(), atol=TOL)
        assert sample.cumulative_logprob == pytest.approx(float(scores.sum()), abs=8 * TOL)
        for step, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs)):
            want_v, want_i = torch.log_softmax(gen.logits[step][0].float(), -1).topk(5)
            top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items())
            assert [t for _, t, _ in top] == want_i.tolist()  # greedy: the chosen token is rank 1
            assert torch.allclose(torch.tensor([v for _, _, v in top]), want_v, atol=TOL)
            assert entry[token].rank == 1 and entry[token].decoded_token == llm.tokenizer.convert_ids_to_tokens(token)


def test_sampled_logprobs_are_of_the_raw_distribution(llm: LLM, hf: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=10, ignore_eos=True, seed=5, logprobs=0, n=2)
    out = llm.generate([PROMPTS[1]], params)[0]
    for sample in out.outputs:
        ids = PROMPTS[1] + sample.token_ids
        raw = raw_logprobs(hf, ids)[len(PROMPTS[1]) - 1 : -1]  # [10, V] the positions that chose them
        want = raw.gather(1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        assert sample.logprobs is not None
        assert all(len(entry) == 1 for entry in sample.logprobs)  # K = 0: only the chosen token
        got = torch.tensor([e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs)])
        assert torch.allclose(got, want, atol=TOL)
        ranks = [e[t].rank for t, e in zip(sample.token_ids, sample.logprobs)]
        assert ranks == [int((row > w).sum()) + 1 for row, w in zip(raw, want)]


def test_no_logprobs_unless_asked(llm: LLM) -> None:
    sample = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert sample.logprobs is None and sample.cumulative_logprob is None


def test_prompt_logprobs_match_transformers_across_chunks_and_cache(llm: LLM, hf: torch.nn.Module) -> None:
    prompt = PROMPTS[2]
    llm.generate([prompt + [7]], SamplingParams(temperature=0.0, max_tokens=1))  # caches its full blocks
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3))[0]
    assert out.num_cached_tokens == 0  # prompt logprobs skip the prefix cache: cached positions have no logits
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    raw = raw_logprobs(hf, prompt)
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert entry is not None and prompt[j] in entry
        assert abs(entry[prompt[j]].logprob - float(raw[j - 1, prompt[j]])) < TOL
        top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None and lp.rank <= 3)
        assert [t for _, t in top][:3] == raw[j - 1].topk(3).indices.tolist()


def test_max_tokens_zero_scores_without_generating(llm: LLM, hf: torch.nn.Module) -> None:
    before = llm.stats["output_tokens"]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))
    assert llm.stats["output_tokens"] == before
    for prompt, out in zip(PROMPTS, outs):
        assert [(s.index, s.token_ids, s.text, s.finish_reason) for s in out.outputs] == [
            (0, [], "", "length"),
            (1, [], "", "length"),
        ]
        raw = raw_logprobs(hf, prompt)
        assert out.prompt_logprobs is not None
        total = sum(e[t].logprob for t, e in zip(prompt[1:], out.prompt_logprobs[1:]) if e is not None)
        want = float(sum(raw[j - 1, prompt[j]] for j in range(1, len(prompt))))
        assert total == pytest.approx(want, abs=len(prompt) * TOL)


def test_max_tokens_none_runs_to_the_context(llm: LLM) -> None:
    out = llm.generate([[9] * 190], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_logprobs_range_is_checked() -> None:
    with pytest.raises(ValueError, match="logprobs must be null or an integer in"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
