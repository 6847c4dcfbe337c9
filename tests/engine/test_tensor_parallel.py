"""Tensor parallelism on the CPU (gloo): TP=2 gives the tokens of TP=1, and a failing rank ends cleanly.

The reference is the single-device engine, itself checked token for token against transformers
(test_parity). Greedy parity runs the parity grid's prompts under pressure (prefix caching,
chunked prefill, preemption) for every architecture with a sharding plan; the others must be
refused before any process starts. One TP engine (llama) then checks seeded sampling, logprobs,
recovery from an exception on rank 0, and finally the death of a rank. After each engine is
closed no process of ours is left.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.parallel.group import TensorParallelError
from batchgen.engine.parallel.plan import SHARDABLE
from batchgen.engine.runner.models import UnsupportedModelError
from testkit.tiny_models import tiny_configs

from .conftest import ARCHITECTURES
from .test_parity import MAX_TOKENS, PRESSURE, PROMPTS

SETTINGS = dict(PRESSURE, attention_backend="cpu", compile=False)
SPLIT = [a for a in ARCHITECTURES if tiny_configs()[a].get_text_config().model_type in SHARDABLE]
REFUSED = [a for a in ARCHITECTURES if a not in SPLIT]


def children() -> list[int]:
    """Pids of this process's living child processes (zombies excluded), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(entry))
    return found


def _greedy(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in MAX_TOKENS[: len(prompts)]]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("arch", SPLIT)
def test_tp2_greedy_equals_tp1(arch: str, tiny_model: Callable[[str], Path]) -> None:
    path = str(tiny_model(arch))
    want = _greedy(LLM(path, **SETTINGS))  # type: ignore[arg-type]
    before = set(children())
    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)  # type: ignore[arg-type]
    try:
        assert len(set(children()) - before) == 1  # one worker: rank 1
        assert _greedy(llm) == want
        assert llm.stats["preemptions"] > 0 and llm.stats["cached_tokens"] > 0  # the pressure was real
        shape = llm.engine.runner.kv_caches[0][0].shape  # [blocks, block_size, KV heads per rank, D]
        text = tiny_configs()[arch].get_text_config()
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        assert shape[2] == kv_heads // 2  # each rank's pool holds its half of the KV heads
    finally:
        llm.close()
    assert set(children()) <= before


@pytest.mark.parametrize("arch", REFUSED)
def test_architectures_without_a_plan_are_refused_before_any_process(
    arch: str, tiny_model: Callable[[str], Path]
) -> None:
    before = set(children())
    with pytest.raises(UnsupportedModelError, match="cannot be split"):
        LLM(str(tiny_model(arch)), tensor_parallel_size=2, **SETTINGS)  # type: ignore[arg-type]
    assert set(children()) <= before


def test_heads_not_divisible_are_refused(tiny_model: Callable[[str], Path]) -> None:
    with pytest.raises(UnsupportedModelError, match="4 attention heads are not divisible by 3"):
        LLM(str(tiny_model("llama")), tensor_parallel_size=3, **SETTINGS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def pair(tiny_model: Callable[[str], Path]) -> Iterator[tuple[LLM, LLM]]:
    """(TP=1, TP=2) engines over the tiny llama; the TP=2 one closed at the end."""
    path = str(tiny_model("llama"))
    one = LLM(path, **SETTINGS)  # type: ignore[arg-type]
    two = LLM(path, tensor_parallel_size=2, **SETTINGS)  # type: ignore[arg-type]
    yield one, two
    two.close()


def test_seeded_sampling_and_logprobs_equal_tp1(pair: tuple[LLM, LLM]) -> None:
    one, two = pair
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=100 + i, logprobs=3, prompt_logprobs=2)
        for i in range(12)
    ]
    a, b = one.generate(PROMPTS[8:20], params), two.generate(PROMPTS[8:20], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    for x, y in zip(a, b):
        for want, got in zip(x.outputs[0].logprobs or [], y.outputs[0].logprobs or []):
            assert want.keys() == got.keys()
            assert all(abs(want[t].logprob - got[t].logprob) < 1e-4 for t in want)
        for want, got in zip((x.prompt_logprobs or [])[1:], (y.prompt_logprobs or [])[1:]):
            assert want is not None and got is not None
            assert all(abs(want[t].logprob - got[t].logprob) < 1e-4 for t in want if t in got)


def test_forked_samples_equal_tp1(pair: tuple[LLM, LLM]) -> None:
    """n > 1: the samples fork mid-step on rank 0 (a scheduler diff inside the step, replayed by
    the worker at the same point); each sample's tokens equal TP=1's."""
    one, two = pair
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3)
    a, b = one.generate(PROMPTS[20:26], params), two.generate(PROMPTS[20:26], params)
    assert [[s.token_ids for s in o.outputs] for o in a] == [[s.token_ids for s in o.outputs] for o in b]


def test_embedding_through_a_tp_engine_is_refused_not_left_waiting(pair: tuple[LLM, LLM]) -> None:
    """A generate LLM embeds through its own engine; sharded, rank 0 alone would wait in the
    all-reduce until the timeout, so it is refused, and the engine still generates."""
    one, two = pair
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        two.embed(PROMPTS[:2])
    assert _greedy(two, PROMPTS[:4]) == _greedy(one, PROMPTS[:4])


def test_an_exception_on_rank0_aborts_and_the_engine_goes_on(pair: tuple[LLM, LLM]) -> None:
    one, two = pair

    def boom(_: object) -> None:
        raise KeyError("a caller's callback failed")

    with pytest.raises(KeyError):
        two.generate(PROMPTS[:8], SamplingParams(max_tokens=6, temperature=0.0), on_output=boom)
    assert _greedy(two, PROMPTS[:16]) == _greedy(one, PROMPTS[:16])  # the workers dropped their state too


def test_a_killed_rank_ends_generate_with_a_clear_error(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 SIGKILLs itself before its 5th step (a fault point): rank 0 names it, nothing hangs,
    no process is left, and the engine refuses further work instead of hanging in a collective."""
    monkeypatch.setenv("BATCHGEN_FAULT", "tp_rank_step:5")  # the worker inherits it
    before = set(children())
    llm = LLM(str(tiny_model("llama")), tensor_parallel_size=2, **SETTINGS)  # type: ignore[arg-type]
    try:
        with pytest.raises(TensorParallelError, match=f"rank 1 .* exited with code {-signal.SIGKILL}"):
            _greedy(llm)
        assert set(children()) <= before
        with pytest.raises(TensorParallelError, match="shut down"):
            _greedy(llm, PROMPTS[:2])
    finally:
        llm.close()


def test_a_hung_rank_times_out_instead_of_hanging(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 stopped (SIGSTOP, as a wedged process): rank 0's next collective times out after
    BATCHGEN_TP_TIMEOUT_S, the step fails with a clear error, and the stopped worker is killed."""
    monkeypatch.setenv("BATCHGEN_TP_TIMEOUT_S", "3")
    before = set(children())
    llm = LLM(str(tiny_model("llama")), tensor_parallel_size=2, **SETTINGS)  # type: ignore[arg-type]
    try:
        (worker,) = set(children()) - before
        os.kill(worker, signal.SIGSTOP)
        with pytest.raises(TensorParallelError, match="Timed out"):
            _greedy(llm, PROMPTS[:4])
        assert set(children()) <= before
    finally:
        llm.close()
