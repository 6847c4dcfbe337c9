"""The attention-backend interface: state per engine, layers bound by index, backends chosen by a setting.

Two engines in one process must not see each other's step (no module globals), a layer must
reach its own KV pool whatever order layers run in, and every backend must give the tokens the
portable torch backend gives.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention.backend import TorchBackend
from batchgen.engine.attention.interface import BINDING, paged_attention_forward
from batchgen.engine.attention.planning import build_forward_context
from batchgen.engine.cpu import native
from batchgen.engine.cpu.backend import CpuBackend

from .attention_harness import CPU_STAGER, Layer, running
from .test_attention import BLOCK, DIM, HEADS, KV_HEADS, _chunk, _source

PROMPTS = [[(7 * i + j) % 250 + 2 for j in range(3 + 9 * i)] for i in range(6)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _alone(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _interleaved(first: LLM, second: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Both engines' requests run step by step, alternating: each step of one between two of the other."""
    results: list[dict[str, RequestOutput]] = [{}, {}]
    engines = [first.engine, second.engine]
    for engine in engines:
        for prompt in PROMPTS:
            engine.add_request(prompt, PARAMS)
    while any(e.has_unfinished() for e in engines):
        for engine, done in zip(engines, results):
            if engine.has_unfinished():
                done.update((o.request_id, o) for o in engine.step())
    tokens = [[done[k].outputs[0].token_ids for k in sorted(done, key=int)] for done in results]
    return tokens[0], tokens[1]


@pytest.mark.parametrize(
    ("backends", "compile"), [(("cpu", "cpu"), False), (("cpu", "torch"), False), (("cpu", "cpu"), True)]
)
def test_two_engines_used_alternately_give_the_tokens_each_gives_alone(
    backends: tuple[str, str], compile: bool, tiny_model: Callable[[str], Path]
) -> None:
    paths = [tiny_model("llama"), tiny_model("qwen2")]  # different weights: a mix-up changes tokens
    settings = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "block_size": 8, "compile": compile}
    llms = [LLM(str(p), attention_backend=b, **settings) for p, b in zip(paths, backends)]  # type: ignore[arg-type]
    alone = [_alone(llm) for llm in llms]
    assert alone[0] != alone[1]
    assert _interleaved(llms[0], llms[1]) == (alone[0], alone[1])
    # each engine's backend attended only its own steps
    fronts = [llm.engine.runner.backend for llm in llms]
    for backend in fronts:
        if isinstance(backend, CpuBackend) and backend.front is not None:
            assert backend.front.stats.steps > 0
    if all(isinstance(b, CpuBackend) and b.front is not None for b in fronts):
        assert fronts[0].front is not fronts[1].front  # type: ignore[union-attr]


def test_two_engines_in_two_threads_at_once_give_the_tokens_each_gives_alone(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of the two engines overlap in time (torch releases the GIL inside its ops): a step
    plan kept anywhere but in each engine's own backend would be read by the other engine."""
    import threading

    monkeypatch.setenv("BATCHGEN_ADAPTIVE_THREADS", "0")  # why: one thread count for every run compared
    settings = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "block_size": 8, "compile": False}
    llms = [LLM(str(tiny_model(arch)), **settings) for arch in ("llama", "qwen2")]  # type: ignore[arg-type]
    alone = [_alone(llm) for llm in llms]
    together: list[list[list[int]]] = [[], []]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for _ in range(3):
                together[i].extend(_alone(llms[i]))
        except BaseException as exc:  # reported below: an exception in a thread fails nothing on its own
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert together == [alone[0] * 3, alone[1] * 3]


def test_every_attention_module_is_bound_to_its_engines_backend_by_layer_index(
    tiny_model: Callable[[str], Path],
) -> None:
    llm = LLM(str(tiny_model("mistral")), device="cpu", num_kv_blocks=16)
    runner = llm.engine.runner
    bound = [(m.layer_idx, getattr(m, BINDING)) for m in runner.model.modules() if hasattr(m, BINDING)]
    assert sorted({idx for idx, _ in bound}) == list(range(len(runner.kv_caches)))
    assert all(b.backend is runner.backend and b.layer == idx for idx, b in bound)


def test_a_layer_reaches_its_own_pool_whatever_order_layers_run_in() -> None:
    """Layer 1 called before layer 0 (and no call for layer 2) still writes pool 1, then pool 0."""
    pools = [(torch.zeros(4, BLOCK, KV_HEADS, DIM), torch.zeros(4, BLOCK, KV_HEADS, DIM)) for _ in range(3)]
    ctx, _, _ = build_forward_context([_chunk(0, 0, 3, [2], False)], _source("gather"), pools, BLOCK, CPU_STAGER)
    keys = [torch.randn(1, KV_HEADS, 3, DIM) for _ in range(3)]
    with running(ctx, layer_idx=1) as second:
        backend = getattr(second, BINDING).backend
        first = Layer(0)
        object.__setattr__(first, BINDING, type(getattr(second, BINDING))(backend, 0))
        for layer, key in ((second, keys[1]), (first, keys[0])):
            paged_attention_forward(layer, torch.randn(1, HEADS, 3, DIM), key, key.clone(), None)
    for i in (0, 1):
        torch.testing.assert_close(pools[i][0][2, :3], keys[i][0].transpose(0, 1))
    assert not pools[2][0].any()  # the layer that did not run left its pool alone
    assert ctx.num_attention_calls == 2


def test_the_setting_picks_the_backend_and_a_bad_one_is_named(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # why: triton runs on the CPU under the interpreter
    path = str(tiny_model("llama"))
    assert isinstance(LLM(path, device="cpu", num_kv_blocks=16).engine.runner.backend, CpuBackend)  # auto on CPU
    torch_backend = LLM(path, device="cpu", num_kv_blocks=16, attention_backend="torch").engine.runner.backend
    assert type(torch_backend) is TorchBackend and torch_backend.describe() == "torch"
    with pytest.raises(ValueError, match="attention_backend 'triton' runs on CUDA"):
        LLM(path, device="cpu", attention_backend="triton")


def test_the_cpu_backend_is_the_torch_one_where_the_native_kernel_cannot_attend(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2 soft-caps its logits, which the kernel cannot; with BATCHGEN_NATIVE=0 nothing loads:
    `cpu` then makes the torch backend (gathered blocks), whose tokens are the kernel's."""
    prompts = [[2 + (i * 5 + j) % 250 for j in range(n)] for i, n in enumerate([6, 19, 33])]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    gemma2 = LLM(str(tiny_model("gemma2")), device="cpu", attention_backend="cpu", compile=False)
    assert type(gemma2.engine.runner.backend) is TorchBackend
    path = str(tiny_model("llama"))
    with_kernel = LLM(path, device="cpu", attention_backend="cpu", compile=False)
    assert isinstance(with_kernel.engine.runner.backend, CpuBackend)
    want = [o.outputs[0].token_ids for o in with_kernel.generate(prompts, params)]
    monkeypatch.setattr(native, "load", lambda: None)  # as BATCHGEN_NATIVE=0 or no compiler leave it
    without = LLM(path, device="cpu", attention_backend="cpu", compile=False)
    assert type(without.engine.runner.backend) is TorchBackend
    assert [o.outputs[0].token_ids for o in without.generate(prompts, params)] == want


def test_a_dropped_engine_leaves_no_backend_behind(tiny_model: Callable[[str], Path]) -> None:
    """The op's table of backends holds them weakly: an engine that is gone is gone."""
    import gc

    from batchgen.engine.attention import op as attention_op

    llm = LLM(str(tiny_model("llama")), device="cpu", num_kv_blocks=16)
    handle = llm.engine.runner.backend.handle
    assert attention_op.lookup(handle) is llm.engine.runner.backend
    del llm
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no live attention backend {handle}"):
        attention_op.lookup(handle)
