"""engine.compile: "auto" compiles on the CPU where a compiler is found, and falls back to eager if
compiling fails; `true` turns a failure into an error."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.config import EngineConfig
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.api.platform import resolve
from batchgen.engine.cpu import platform as cpu_platform
from batchgen.engine.platforms import platform_for
from batchgen.engine.runner import compiled_forward

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def resolve_compile(setting: str | bool, device: torch.device) -> bool:
    """engine.compile as the engine resolves it on `device` (a block size given: no device is asked)."""
    config = EngineConfig(compile=setting, block_size=16)  # type: ignore[arg-type]
    platform = platform_for(device)
    return resolve(config, platform, max_model_len=64, dtype=torch.float32, head_dim=8, softcap=False).compile


def test_auto_compiles_on_the_cpu_with_a_compiler_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_compile("auto", torch.device("cpu"))  # this machine has one (CI too)
    assert resolve_compile("auto", torch.device("cuda"))  # with CUDA graphs of decode steps
    assert not resolve_compile("auto", torch.device("mps"))  # unmeasured there
    assert resolve_compile(True, torch.device("cuda")) and not resolve_compile(False, torch.device("cpu"))
    monkeypatch.setattr(cpu_platform.shutil, "which", lambda name: None)
    assert not resolve_compile("auto", torch.device("cpu"))


def _failing_compile(*args: Any, **kwargs: Any) -> Callable[..., torch.Tensor]:
    def run(*a: Any, **k: Any) -> torch.Tensor:
        raise torch._dynamo.exc.TorchDynamoException("stand-in for a model that does not compile")

    return run


def test_auto_runs_eager_when_compiling_fails(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tiny_model("llama"))
    want = [o.outputs[0].token_ids for o in LLM(path, compile=False).generate(PROMPTS, GREEDY)]
    monkeypatch.setattr(compiled_forward.torch, "compile", _failing_compile)
    llm = LLM(path)  # compile: auto
    assert llm.engine.runner.forward.compile
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert not llm.engine.runner.forward.compile
    assert "torch.compile failed for LlamaForCausalLM; running eager from now on" in caplog.text


def test_compile_true_does_not_hide_a_failure(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compiled_forward.torch, "compile", _failing_compile)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException, match="stand-in"):
        LLM(str(tiny_model("llama")), compile=True).generate(PROMPTS, GREEDY)


def test_an_error_inside_the_compiled_attention_keeps_its_own_message(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph with the C++ wrapper turns an exception of the Python attention op into "API call
    failed"; the engine raises the op's own exception instead (the backend's take_raised)."""
    llm = LLM(str(tiny_model("llama")), compile=True)
    llm.generate(PROMPTS, GREEDY)  # compiled

    def failing(*args: object) -> torch.Tensor:
        raise ValueError("the attention's own words")

    monkeypatch.setattr(llm.engine.runner.backend, "run_layer", failing)
    with pytest.raises(ValueError, match="the attention's own words"):
        llm.generate(PROMPTS, GREEDY)


def test_each_compiled_model_runs_its_own_graph(tiny_model: Callable[[str], Path], tmp_path: Path) -> None:
    """Compiled forwards skip the guards on their model (compiled_forward._argument_guards),
    which is sound only because each StepForward compiles a code object of its own, whose dynamo
    cache holds that one model's graph: a second model of another depth in the same process gets
    a graph of its own and the same tokens as eager."""
    import copy

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from testkit.tiny_models import save_random_model, tiny_configs

    config = copy.deepcopy(tiny_configs()["llama"])
    config.num_hidden_layers = 3
    paths = [str(tiny_model("llama")), str(save_random_model(config, tmp_path / "deeper", seed=1))]
    compiled = [LLM(path, compile=True) for path in paths]
    got = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] for llm in compiled]
    want = [[o.outputs[0].token_ids for o in LLM(path, compile=False).generate(PROMPTS, GREEDY)] for path in paths]
    assert got == want and want[0] != want[1]
    codes = [llm.engine.runner.forward._run._torchdynamo_orig_callable.__func__.__code__ for llm in compiled]
    assert codes[0] is not codes[1]
    assert [len(_debug_get_cache_entry_list(code)) for code in codes] == [1, 1]


def test_a_compiled_engine_says_in_one_line_why_its_first_steps_are_slow(
    tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tiny_model("llama"))
    with caplog.at_level(logging.INFO, logger=compiled_forward.__name__):
        LLM(path, compile=False)
        assert not [r for r in caplog.records if "torch.compile" in r.getMessage()]
        LLM(path, compile=True)
    said = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(said) == 1 and "first steps" in said[0] and "engine.compile: false" in said[0], said


@pytest.fixture
def _keep_threads() -> Any:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("_keep_threads")
def test_a_new_thread_count_runs_the_graph_already_compiled(tiny_model: Callable[[str], Path]) -> None:
    """The thread governor (cpu/threads) changes torch's thread count in the middle of a job;
    dynamo would recompile the forward for each new count (its global-state guard), so the
    compiled forward checks that state itself, less the count, and its kernels read the count
    when they run. Same graph, same tokens, at any count; the engine hears of each compiling call
    (the governor restarts its measurement then)."""
    torch.set_num_threads(2)
    path = str(tiny_model("llama"))
    llm = LLM(path, compile=True)
    heard: list[int] = []
    llm.engine.runner.forward.on_compiled = lambda: heard.append(llm.engine.runner.forward.stats.graphs)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    graphs = llm.engine.runner.forward.stats.graphs
    assert graphs >= 1 and heard and heard[-1] == graphs
    for threads in (1, 3, 2):
        torch.set_num_threads(threads)
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert llm.engine.runner.forward.stats.graphs == graphs and heard[-1] == graphs


def test_a_call_under_other_torch_settings_runs_eager_instead_of_recompiling(
    tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    llm = LLM(str(tiny_model("llama")), compile=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    graphs = llm.engine.runner.forward.stats.graphs
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(not before)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        torch.use_deterministic_algorithms(before)
    assert got == want and llm.engine.runner.forward.stats.graphs == graphs
    assert caplog.text.count("traced under other torch settings (deterministic_algorithms differs)") == 1


def test_the_next_engine_of_a_model_reuses_its_compiled_graph(
    tiny_model: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's graph cache serves an engine's compiled forward to the next engine of the same model
    (the next job's process, or this one once the first engine is dropped), which skips most of the
    compile: the graph holds small constants (the attention handle, the layer), never an address."""
    import gc

    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    path = str(tiny_model("llama"))

    def run() -> tuple[list[list[int]], bool]:
        llm = LLM(path, compile=True)
        tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        fronted = getattr(llm.engine.runner.backend, "front", None) is not None
        del llm
        gc.collect()
        return tokens, fronted

    gc.collect()  # engines earlier tests left for the collector: their handles are freed before, not between, the runs
    counters.clear()
    first, fronted = run()
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1 and fronted  # the C++ front's call is in the graph
    misses = counters["inductor"]["fxgraph_cache_miss"]
    second, _ = run()
    assert second == first
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and counters["inductor"]["fxgraph_cache_miss"] == misses
