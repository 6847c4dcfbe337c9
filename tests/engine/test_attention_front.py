"""The C++ front of the attention (batchgen::attention): planned decode steps without Python per layer.

It must attend exactly as the Python path does (the same kernel with the same arguments), hand
every unplanned call to the Python op, refuse what the kernel could not address with a message
that survives a compiled graph, and leave the engine's tokens as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.cpu import front as attention_front
from batchgen.engine.cpu.backend import CpuBackend
from batchgen.engine.cpu.decode_native import PLAN_FIELDS, ClassRows, FrontPlan, NativeStep, Scratch

from .test_native import TILE

KVH, G, D = 2, 2, 16
LAYERS = 2


def _step(gen: torch.Generator) -> tuple[NativeStep, list[ClassRows]]:
    """Two classes, one with holes and a shared prefix, in fresh row tensors."""
    lengths, rows = [[5, 17, 40], [33, 64, 50, 47]], [[0, 1, 2], [1, 2, 4, 5]]
    parts = []
    for cap, ls, rs, shared in ((64, lengths[0], rows[0], 0), (64, lengths[1], rows[1], 32)):
        k = [torch.randn(6, KVH, cap // TILE, D, TILE, generator=gen) for _ in range(LAYERS)]
        v = [torch.randn(6, KVH, cap, D, generator=gen) for _ in range(LAYERS)]
        for layer in range(LAYERS):
            k[layer][rs, :, : shared // TILE] = k[layer][rs[0], :, : shared // TILE]
            v[layer][rs, :, :shared] = v[layer][rs[0], :, :shared]
        parts.append(ClassRows(k, v, len(ls), shared, rs))
    return NativeStep(parts, lengths[0] + lengths[1], Scratch()), parts


def _copy(parts: list[ClassRows]) -> list[ClassRows]:
    return [ClassRows([t.clone() for t in p.k], [t.clone() for t in p.v], p.num_rows, p.shared, p.rows) for p in parts]


def test_a_planned_step_attends_exactly_as_the_python_path() -> None:
    gen = torch.Generator().manual_seed(11)
    python_step, parts = _step(gen)
    copied = _copy(parts)
    front_step = NativeStep(copied, [5, 17, 40, 33, 64, 50, 47], Scratch())
    n, tokens, real = 7, 16, 9  # 7 decodes, 2 more real tokens the plan ignores, 7 rows of padding
    pools = [tuple(torch.zeros(10, 4, KVH, D) for _ in range(2)) for _ in range(LAYERS)]
    front_pools = [tuple(t.clone() for t in pool) for pool in pools]
    slots = torch.tensor([3, 9, 12, 20, 27, 31, 39] + [-1] * (tokens - n))
    plan = front_step.front_plan(front_pools, slots, KVH * G, real)
    assert len(plan.fields) == len(PLAN_FIELDS) + 2 * LAYERS
    front = attention_front.open_front(0)  # handle 0: no backend holds it
    assert front is not None
    with front.planned(plan):
        for layer in range(LAYERS):
            q = torch.randn(tokens, KVH * G, D, generator=gen).transpose(0, 1)  # [H, T, D], strided as the model's
            key, value = torch.randn(2, tokens, KVH, D, generator=gen).transpose(1, 2)
            expected = torch.zeros(tokens, KVH * G, D)
            window = 7 if layer else None  # a sliding window goes through too
            python_step.attend(layer, q, key, value, expected, D**-0.5, window, pools[layer], slots)
            out = torch.ops.batchgen.attention(q, key, value, D**-0.5, window, None, front.handle, layer)
            torch.testing.assert_close(out[:n], expected[:n], rtol=0, atol=0)
            assert not out[real:].any()  # padding rows are zeroed
    # the same rows and pool slots written, to the bit
    for a, b in zip(parts, copied):
        for x, y in zip(a.k + a.v, b.k + b.v):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    for a, b in zip(pools, front_pools):
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
        torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)
        assert b[0].flatten(0, 1)[slots[:n]].abs().amin() > 0  # every decode's key was stored
    assert front.stats.layers == LAYERS == plan.calls and front.stats.steps == 1 and plan.kernel_seconds > 0


def _plan_and_inputs() -> tuple[NativeStep, tuple[FrontPlan, list, torch.Tensor], tuple[torch.Tensor, ...]]:
    step, _ = _step(torch.Generator().manual_seed(3))
    pools = [tuple(torch.zeros(10, 4, KVH, D) for _ in range(2)) for _ in range(LAYERS)]
    slots = torch.arange(7)
    plan = step.front_plan(pools, slots, KVH * G, 7)
    q, key, value = torch.zeros(KVH * G, 8, D), torch.zeros(KVH, 8, D), torch.zeros(KVH, 8, D)
    return step, (plan, pools, slots), (q, key, value)


def test_a_planned_call_the_kernel_could_not_address_is_refused() -> None:
    _, _, (q, key, value) = _plan_and_inputs()
    front = attention_front.open_front(0)  # handle 0: no backend holds it
    assert front is not None

    def attend(*args: object, layer: int = 0) -> torch.Tensor:
        return torch.ops.batchgen.attention(*args, front.handle, layer)

    cases = [
        (r"q \[3, 8, 16\].* for 7 decodes over 4 heads, 2 K/V heads of 16", (q[:3], key, value, 1.0, None, None)),
        ("float32 CPU tensors", (q.double(), key.double(), value.double(), 1.0, None, None)),
        ("soft-caps", (q, key, value, 1.0, None, 30.0)),
    ]
    for message, args in cases:
        _, (plan, *_), _ = _plan_and_inputs()
        with front.planned(plan), pytest.raises(RuntimeError, match=message):
            attend(*args)
    _, (plan, *_), _ = _plan_and_inputs()
    front.take_error()  # what earlier calls left, as each compiled step forgets it first
    with front.planned(plan):
        for layer in range(LAYERS):
            attend(q, key, value, 1.0, None, None, layer=layer)
        with pytest.raises(RuntimeError, match="layer 2 of a plan for 2 layers"):
            attend(q, key, value, 1.0, None, None, layer=LAYERS)
    message = front.take_error()  # the last refusal's message, kept for a compiled graph's caller
    assert message is not None and "layer 2 of a plan for 2 layers" in message
    assert front.take_error() is None  # and forgotten once taken


def test_a_plan_the_kernel_could_not_address_is_refused() -> None:
    step, (_, pools, slots), _ = _plan_and_inputs()
    with pytest.raises(RuntimeError, match="3 heads"):
        step.front_plan(pools, slots, 3, 7)  # not a multiple of the K/V heads
    with pytest.raises(RuntimeError, match="1 pools"):
        step.front_plan(pools[:1], slots, KVH * G, 7)
    odd = [pools[0], (pools[1][0], torch.zeros(9, 4, KVH, D))]
    with pytest.raises(RuntimeError, match="pools"):
        step.front_plan(odd, slots, KVH * G, 7)
    with pytest.raises(RuntimeError, match="slots"):
        step.front_plan(pools, slots[:6], KVH * G, 7)
    with pytest.raises(RuntimeError, match="slots"):
        step.front_plan(pools, slots.int(), KVH * G, 7)


def _generate(path: Path, front: bool = True) -> tuple[list[list[int]], list[bool], int]:
    """Greedy tokens of prompts that share a prefix and cross row classes while decoding, for every
    call of the backend's Python body whether its step had prefills, and the steps the front attended.
    `front` False: the backend calls the Python op, as without a C++ compiler."""
    seen: list[bool] = []
    llm = LLM(str(path), device="cpu", dtype="float32", compile=False, max_num_batched_tokens=256)
    backend = llm.engine.runner.backend
    assert isinstance(backend, CpuBackend) and backend.front is not None
    if not front:
        backend.front = None
    body = backend.run_layer

    def watched(*args: object) -> torch.Tensor:
        assert backend.context is not None
        seen.append(bool(backend.context.prefills))
        return body(*args)  # type: ignore[arg-type]

    backend.run_layer = watched  # type: ignore[method-assign]  # the op's body and the eager call alike
    prefix = list(range(5, 45))
    prompts = [prefix + [7 + i] * (i * 9) for i in range(6)] + [[3, 4], list(range(60, 120))]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert backend.decode_kv.num_fills > 0  # rows were filled (new sequences, class crossings)
    steps = backend.front.stats.steps if backend.front is not None else 0
    return [o.outputs[0].token_ids for o in outs], seen, steps


def test_decode_steps_never_reach_python_and_the_tokens_are_the_same(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama")
    tokens, seen, steps = _generate(path)
    assert steps >= 39  # each decode-only step
    assert seen and all(seen)  # the Python body ran only in steps with prefills
    off_tokens, off_seen, _ = _generate(path, front=False)
    assert not all(off_seen) and off_tokens == tokens


def test_a_refusal_inside_a_compiled_graph_keeps_its_message(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = NativeStep.front_plan

    def wrong_heads(self: NativeStep, *args: object) -> FrontPlan:
        plan = real(self, *args)  # type: ignore[arg-type]
        plan.fields[PLAN_FIELDS.index("heads")] += self._kvh
        return plan

    monkeypatch.setattr(NativeStep, "front_plan", wrong_heads)
    llm = LLM(str(tiny_model("llama")), device="cpu", dtype="float32", compile=True)
    with pytest.raises(RuntimeError, match=r"batchgen::attention: q \[4, \d+, 16\].* over 6 heads"):
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))


def test_an_operator_whose_plan_names_differ_from_pythons_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The plan and the kernel's arguments are named once (csrc/decode_args.h) and exported by the
    operator's library: a Python side out of step with them refuses the library instead of
    writing fields at the wrong offsets."""
    assert attention_front.load.__wrapped__() is not None  # in step: loads
    monkeypatch.setattr(attention_front, "PLAN_FIELDS", PLAN_FIELDS[1:])
    assert attention_front.load.__wrapped__() is None
    assert "batchgen_attention_op kernel unavailable" in caplog.text and "attention_op.cpp names" in caplog.text
