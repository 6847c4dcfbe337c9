"""One upload and at most one device->host read per step, whatever features a request uses.

Each feature alone, and all of them together, runs through an engine whose Transfers copies as on
a GPU (`copy=True`: staged views valid only after the upload, reads through one concatenated
copy), under a SyncCounter (tests/engine/sync_counter.py) that sees every read of a device value
and every upload that bypasses Transfers. Every step must upload once, read at most once (exactly
once when it sampled), and the counter must see nothing else; the tokens must equal those of the
CPU's own path (no copies, host reads allowed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.staging.transfers import Transfers
from tests.engine.sync_counter import SyncCounter

PROMPTS = ["once upon a time", "the cat liked to play", "a little dog who liked the sun"]
BASE: dict[str, Any] = {"max_tokens": 8, "ignore_eos": True}


def _p(**fields: Any) -> SamplingParams:
    return SamplingParams(**{**BASE, **fields})


ALL = dict(
    temperature=0.9,
    top_k=30,
    top_p=0.8,
    min_p=0.02,
    seed=3,
    repetition_penalty=1.3,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    logit_bias={5: 2.0},
    bad_words=["cat"],
    min_tokens=3,
    logprobs=3,
    prompt_logprobs=2,
    stop=["sun"],
    n=2,
)
CASES: dict[str, list[SamplingParams]] = {
    "greedy": [_p(temperature=0.0)],
    "temperature": [_p(temperature=0.7, seed=1)],
    "top_k": [_p(temperature=1.0, top_k=5, seed=1)],
    "top_p": [_p(temperature=1.0, top_p=0.6, seed=1)],
    "min_p": [_p(temperature=1.0, min_p=0.1, seed=1)],
    "seeds_mixed": [_p(temperature=1.0, seed=4), _p(temperature=1.0), _p(temperature=0.0)],
    "presence_frequency": [_p(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5)],
    "repetition": [_p(temperature=0.0, repetition_penalty=1.5)],
    "bias_bans_allowed_min_tokens": [
        _p(temperature=0.0, logit_bias={7: 3.0}, bad_words=["the cat"], min_tokens=4),
        _p(temperature=0.0, allowed_token_ids=list(range(3, 60))),
    ],
    "logprobs": [_p(temperature=0.0, logprobs=4, prompt_logprobs=3)],
    "scoring_only": [_p(max_tokens=0, prompt_logprobs=2)],
    "n": [_p(temperature=0.8, seed=9, n=3)],
    "stop_strings": [_p(temperature=0.0, stop=["the", "a"], ignore_eos=False)],
    "structured": [_p(temperature=1.0, seed=2, structured={"choice": ["yes", "no", "maybe not"]}, max_tokens=20)],
    "everything": [
        _p(**ALL),
        _p(**{**ALL, "seed": None, "structured": {"regex": "[ab]{3}-[0-9]{2}"}, "n": 1, "max_tokens": 20}),
        _p(temperature=0.0, logprobs=0),
    ],
}


def _llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, compile=False, max_num_seqs=16)


def _gpu_like(llm: LLM, counter: SyncCounter) -> None:
    """Transfers that copy as on a GPU, their sanctioned calls wired into the counter."""
    runner = llm.engine.runner
    transfers = Transfers(torch.device("cpu"), copy=True)
    transfers.stage = counter.sanction(transfers.stage, mark=True)  # type: ignore[method-assign]
    transfers._send = counter.sanction(transfers._send)  # type: ignore[method-assign]
    transfers.read = counter.sanction(transfers.read)  # type: ignore[method-assign]
    runner.transfers = runner.batch.transfers = transfers
    runner.backend.plan = counter.sanction(runner.backend.plan)  # type: ignore[method-assign]
    runner.backend.running = _paused(runner.backend.running, counter)  # type: ignore[method-assign]
    runner.forward = _Forward(runner.forward, counter)  # type: ignore[assignment]
    # why: the CPU's native argmax is that device's own greedy pass; a GPU has none
    llm.engine.runner.sampler.fast_greedy = None  # type: ignore[union-attr]  # the engine's runner samples
    counter.mark(runner.kv_caches)


def _paused(running: Callable[[Any], Any], counter: SyncCounter) -> Callable[[Any], Any]:
    """The backend's `running` context (its rows filled from the pool, the forward inside) with counting paused."""

    @contextmanager
    def paused_running(ctx: Any) -> Iterator[None]:
        with counter.paused(), running(ctx):
            yield

    return paused_running


class _Forward:
    """The runner's StepForward with counting paused inside; its logits are device memory."""

    def __init__(self, forward: Any, counter: SyncCounter) -> None:
        self._forward = forward
        self._call = counter.sanction(forward, mark=True)

    def __call__(self, *args: Any) -> torch.Tensor:
        return self._call(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._forward, name)


def _run(llm: LLM, params: list[SamplingParams]) -> tuple[list[Any], list[tuple[int, int, int]]]:
    """Outputs in input order, and (uploads, reads, tokens sampled) of every step."""
    engine, counts = llm.engine, llm.engine.runner.transfers.counts
    ids = [engine.add_request(llm.tokenizer(p)["input_ids"], params[i % len(params)]) for i, p in enumerate(PROMPTS)]
    outputs: dict[str, Any] = {}
    steps = []
    while engine.has_unfinished():
        before, tokens = (counts.uploads, counts.reads), engine.stats.output_tokens
        for out in engine.step():
            outputs[out.request_id] = out
        after = (counts.uploads, counts.reads)
        steps.append((after[0] - before[0], after[1] - before[1], engine.stats.output_tokens - tokens))
    return [outputs[str(i)] for i in ids], steps


def _tokens(outputs: list[Any], params: list[SamplingParams]) -> list[Any]:
    """What must not depend on the path: every sample of requests that are greedy or seeded."""
    kept = []
    for i, out in enumerate(outputs):
        p = params[i % len(params)]
        if p.greedy or p.seed is not None:
            lps = [s.logprobs for s in out.outputs]
            kept.append(([s.token_ids for s in out.outputs], [s.text for s in out.outputs], lps, out.prompt_logprobs))
    return kept


@pytest.mark.parametrize("case", list(CASES))
def test_each_feature_costs_no_sync_beyond_the_one_read(tiny_model_dir: Path, case: str) -> None:
    params = CASES[case]
    want, _ = _run(_llm(tiny_model_dir), params)
    llm, counter = _llm(tiny_model_dir), SyncCounter()
    _gpu_like(llm, counter)
    with counter:
        got, steps = _run(llm, params)
    assert not counter.events, "\n".join(map(str, counter.events))
    assert all(uploads == 1 and reads <= 1 for uploads, reads, _ in steps), steps
    assert all(reads == 1 for _, reads, sampled in steps if sampled), steps
    assert _tokens(got, params) == _tokens(want, params)
    assert llm.engine.runner.batch.num_rows == 0
    tables = llm.engine.runner.batch.features.tables  # type: ignore[union-attr]  # the engine sets features
    assert tables is None or tables._used == len(tables._free)  # every penalized row gave its history slot back


def test_the_counter_sees_each_kind_of_sync() -> None:
    """The counter can fail: each way a step used to sync is seen, named, and placed."""
    counter = SyncCounter()
    with counter:
        device = torch.device("cpu")
        logits = torch.zeros(4, 8, device=device)  # explicit device: device memory
        host_rows = torch.tensor([0, 2])  # host memory
        logits.argmax(dim=-1).tolist()  # read
        bool((logits > 0).any())  # read (_local_scalar_dense)
        logits.sum().item()  # read
        logits[host_rows]  # upload of the index
        torch.tensor([1, 2], device=device)  # upload by creation
        torch.tensor([1.0]).to(device)  # upload by .to
        logits[logits > 0]  # a boolean index: the size needs the values
        logits.cpu()  # read
        safe = logits[torch.arange(2, device=device)].softmax(-1)  # all on the device: nothing
        with counter.paused():
            safe.tolist()  # sanctioned: not counted
    kinds = [e.kind for e in counter.events]
    assert kinds == ["read", "read", "read", "upload", "upload", "upload", "read", "read"], counter.events
