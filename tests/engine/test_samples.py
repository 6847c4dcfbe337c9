"""n samples per prompt: one prefill, shared KV blocks with copy on write, seeded per sample.

Sharing is checked against what needs no sharing: a forked sample's tokens must equal those of a
separate n=1 request with the sample's seed (seed + i), run alone or in another batch; greedy
samples must equal transformers' own greedy generate.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from batchgen.engine.core.block_manager import BlockManager
from batchgen.engine.core.sequence import Sequence

PROMPT = [5 + (i * 7) % 200 for i in range(21)]  # 21 tokens: 2 full blocks of 8 and a partial one


@pytest.fixture(scope="module")
def llm(tiny_model: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model("llama")), device="cpu", block_size=8, num_kv_blocks=64, max_model_len=200)


def sampled(seed: int | None, n: int = 1, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed, n=n)


def test_fork_shares_blocks_and_copies_the_partial_one_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Sequence(0, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4))
    assert bm.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = Sequence(1, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4))
    bm.fork(parent.seq_id, child.seq_id)
    child.num_computed_tokens = 6
    assert bm.block_table(child.seq_id) == bm.block_table(parent.seq_id) == [0, 1] and bm.ref_counts[:2] == [2, 2]
    for seq in (parent, child):
        seq.token_ids.append(9)
    assert bm.allocate_slots(child, 1)  # writes position 6, inside the shared partial block 1
    assert bm.block_table(child.seq_id) == [0, 2] and bm.take_copies() == [(1, 2)]
    assert bm.ref_counts[:3] == [2, 1, 1]
    assert bm.allocate_slots(parent, 1)  # the last holder writes in place: no copy
    assert bm.block_table(parent.seq_id) == [0, 1] and bm.take_copies() == []
    bm.free(parent.seq_id)
    bm.free(child.seq_id)
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8


def test_a_full_last_block_is_never_copied() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = Sequence(0, [1, 2, 3, 4], SamplingParams(max_tokens=4))
    assert bm.allocate_slots(parent, 4)
    parent.num_computed_tokens = 4
    child = Sequence(1, [1, 2, 3, 4], SamplingParams(max_tokens=4))
    bm.fork(parent.seq_id, child.seq_id)
    child.num_computed_tokens = 4
    child.token_ids.append(9)
    assert bm.allocate_slots(child, 1) and bm.block_table(child.seq_id) == [0, 1] and bm.take_copies() == []


def test_n_samples_prefill_once_and_share_the_prompt(llm: LLM) -> None:
    before = llm.stats
    out = llm.generate({"prompt_token_ids": PROMPT}, sampled(seed=7, n=4))[0]
    after = llm.stats
    assert [s.index for s in out.outputs] == [0, 1, 2, 3]
    assert all(len(s.token_ids) == 12 and s.finish_reason == "length" for s in out.outputs)
    # one prefill of the prompt (21 tokens, nothing cached before), then decodes only
    assert after["prefill_tokens"] - before["prefill_tokens"] + out.num_cached_tokens == len(PROMPT)
    assert after["output_tokens"] - before["output_tokens"] == 4 * 12 == out.num_output_tokens
    assert len({tuple(s.token_ids) for s in out.outputs}) > 1  # temperature 1: the samples differ


def test_sample_i_equals_a_lone_request_with_seed_plus_i(llm: LLM) -> None:
    """Copy on write and per-sample seeds: forking changes no sample's tokens, in any batch."""
    forked = llm.generate([PROMPT], sampled(seed=11, n=4))[0]
    alone = [llm.generate([PROMPT], sampled(seed=11 + i))[0].outputs[0].token_ids for i in range(4)]
    assert [s.token_ids for s in forked.outputs] == alone
    others = [[30 + i] * (5 + 3 * i) for i in range(5)]
    crowd = llm.generate(
        [others[0], PROMPT, *others[1:], PROMPT],
        [sampled(None), sampled(11, n=4)] + [sampled(None)] * 4 + [sampled(11, n=4)],
    )
    for out in (crowd[1], crowd[6]):
        assert [s.token_ids for s in out.outputs] == alone


def test_greedy_samples_equal_transformers(llm: LLM, tiny_model: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    want = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=10, min_new_tokens=10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=3)
    out = llm.generate([PROMPT], params)[0]
    assert [s.token_ids for s in out.outputs] == [want[0, len(PROMPT) :].tolist()] * 3


def test_n_samples_under_preemption_finish_with_their_own_tokens(tiny_model: Callable[[str], Path]) -> None:
    """A pool too small for all samples at once: samples are preempted and recomputed, same tokens."""
    small = LLM(str(tiny_model("llama")), device="cpu", block_size=8, num_kv_blocks=12, max_model_len=200)
    params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=3, n=4)
    out = small.generate([PROMPT], params)[0]
    assert small.stats["preemptions"] > 0
    alone = [small.generate([PROMPT], sampled(3 + i, max_tokens=30))[0].outputs[0].token_ids for i in range(4)]
    assert [s.token_ids for s in out.outputs] == alone
    assert small.engine.scheduler.block_manager.num_free_blocks == 12


def test_n_is_validated() -> None:
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        SamplingParams(n=0)


def test_forked_samples_with_gathered_decode_kv(tiny_model: Callable[[str], Path]) -> None:
    """decode_kv gather reads every step's K/V from the pool: the copied block must hold the prompt."""
    gather = LLM(str(tiny_model("llama")), device="cpu", block_size=8, num_kv_blocks=64, attention_backend="torch")
    forked = gather.generate([PROMPT], sampled(seed=21, n=3))[0]
    alone = [gather.generate([PROMPT], sampled(seed=21 + i))[0].outputs[0].token_ids for i in range(3)]
    assert [s.token_ids for s in forked.outputs] == alone
