"""Engine overhead on one decode batch: a native engine step vs the raw HF forward of the same batch.

The floor is transformers' own model forward for B sequences of equal context decoding one
token each (SDPA, DynamicCache, logits for the last token only, argmax): what the hardware
costs with no engine around it. The native side is a whole `Engine.step()` on the same B
sequences (scheduling, metadata, paged attention, sampling, detokenization, stop checks), and
its `ModelRunner.execute` alone (the forward, and the draw with its one read). Raw and native
steps alternate so both see the same machine noise and the same growing context. A second,
instrumented pass splits the native step into phases by wrapping the engine's functions with
timers (the wrappers cost a little themselves).
"""

from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention import backend as attention_backend
from batchgen.engine.attention import gather as decode_gather
from batchgen.engine.attention import torch_math as attention
from batchgen.engine.core.runner_output import ModelRunnerOutput
from batchgen.engine.cpu.decode_native import NativeStep
from batchgen.engine.cpu.decode_rows import RowsView
from batchgen.engine.sampling.sampler import Sampler
from batchgen.engine.sampling.stopping import StopChecker


def _prompts(batch: int, context: int, vocab: int, eos: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # why vocab - 1 and a shift: every id but EOS, so no sequence is cut short by it
    return [[t + (t >= eos >= 0) for t in (rng.randrange(vocab - 1) for _ in range(context))] for _ in range(batch)]


def _native(path: Path, prompts: list[list[int]], steps: int) -> LLM:
    """An LLM whose B sequences are all prefilled and about to decode."""
    llm = LLM(str(path), device="cpu", dtype="float32", max_num_seqs=len(prompts), max_num_batched_tokens=4096)
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=3 * steps + 8, ignore_eos=True))
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    engine.step()  # why: the first decode step may compile (engine.compile); keep it out of the timed steps
    return llm


class _RawDecoder:
    """transformers' forward with a DynamicCache over the same prompts, one token per call."""

    def __init__(self, path: Path, prompts: list[list[int]]) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
        self.cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor(prompts), cache=self.cache, use_cache=True, logits_to_keep=1)
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]

    def step(self) -> None:
        with torch.inference_mode():
            out = self.model(input_ids=self.next, cache=self.cache, use_cache=True, logits_to_keep=1)
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(path: Path, batch: int = 64, context: int = 256, steps: int = 30) -> dict[str, Any]:
    """Median ms of the raw forward, the engine's execute() and its whole step(), and the ratios."""
    llm = _native(path, _prompts(batch, context, llm_vocab(path), llm_eos(path)), steps)
    raw = _RawDecoder(path, [s.token_ids[:context] for s in llm.engine.scheduler.running])
    runner = llm.engine.runner
    real_execute = runner.execute
    execute_times: list[float] = []

    def execute(batch_: Any) -> ModelRunnerOutput:
        start = time.perf_counter()
        out = real_execute(batch_)
        execute_times.append(time.perf_counter() - start)
        return out

    runner.execute = execute  # type: ignore[method-assign]
    raw_times, step_times = [], []
    for _ in range(steps):
        raw_times.append(_timed(raw.step))
        step_times.append(_timed(llm.engine.step))
    runner.execute = real_execute  # type: ignore[method-assign]
    med = {
        k: statistics.median(v) * 1e3
        for k, v in (
            ("raw_forward_ms", raw_times),
            ("native_execute_ms", execute_times),
            ("native_step_ms", step_times),
        )
    }
    result: dict[str, Any] = {
        "batch": batch,
        "context": context,
        "steps": steps,
        **{k: round(v, 2) for k, v in med.items()},
    }
    result["step_over_raw"] = round(med["native_step_ms"] / med["raw_forward_ms"], 3)
    result["execute_over_raw"] = round(med["native_execute_ms"] / med["raw_forward_ms"], 3)
    result["breakdown_ms"] = breakdown(llm, steps)
    return result


def llm_vocab(path: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path).vocab_size


def llm_eos(path: Path) -> int:
    from transformers import AutoConfig

    eos = AutoConfig.from_pretrained(path).eos_token_id
    return eos if isinstance(eos, int) else -1


@contextmanager
def _wrapped(owner: Any, name: str, label: str, totals: dict[str, float]) -> Any:
    """Replace owner.name with a timer that adds its wall time to totals[label]."""
    real = getattr(owner, name)

    def timer(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            totals[label] += time.perf_counter() - start

    setattr(owner, name, timer)
    try:
        yield
    finally:
        setattr(owner, name, real)


def breakdown(llm: LLM, steps: int) -> dict[str, float]:
    """Mean ms per decode step spent in each phase of `Engine.step()` (instrumented pass)."""
    engine = llm.engine
    totals: dict[str, float] = defaultdict(float)
    targets = [
        (engine.scheduler, "schedule", "scheduling"),
        # metadata: packing the step, the decode K/V source's plan() included (it runs inside)
        (engine.runner.backend, "plan", "metadata"),
        (engine.runner, "execute", "execute_total"),
        (engine.runner.forward, "_run", "model_forward_total"),  # StepForward: eager or compiled, both through _run
        (attention_backend, "store_kv", "attn_kv_write"),
        (attention, "gather_blocks", "attn_gather"),
        (decode_gather, "gather_blocks", "attn_gather"),
        (decode_gather, "decode_group_attention", "attn_compute"),  # gathered decodes, cascade included
        (NativeStep, "attend", "attn_compute"),  # the native kernel from Python: K/V stores, row appends, attention
        (RowsView, "_fill", "attn_rows_update"),
        (attention, "_attend_chunk", "attn_compute"),
        (Sampler, "sample", "sampling"),
        (StopChecker, "append", "detokenize_stop"),
    ]
    front = getattr(engine.runner.backend, "front", None)  # the CPU backend's C++ front, where it loaded
    front_kernel = front.stats.kernel_seconds if front is not None else 0.0
    with ExitStack() as stack:
        for owner, name, label in targets:
            stack.enter_context(_wrapped(owner, name, label, totals))
        total = sum(_timed(engine.step) for _ in range(steps))
    # the C++ front's kernel calls (decode-only steps): it times them itself, no Python to wrap
    totals["attn_compute"] += (front.stats.kernel_seconds if front is not None else 0.0) - front_kernel
    per = defaultdict(float, {k: v * 1e3 / steps for k, v in totals.items()})
    attn_keys = ("attn_kv_write", "attn_rows_update", "attn_gather", "attn_compute")
    out = {
        "step_total": total * 1e3 / steps,
        "scheduling": per["scheduling"],
        "metadata": per["metadata"],
        "model_matmuls_and_rest": per["model_forward_total"] - sum(per[k] for k in attn_keys),
        **{k: per[k] for k in attn_keys},
        "runner_other": per["execute_total"] - per["model_forward_total"] - per["metadata"],
        "sampling": per["sampling"],
        "detokenize_stop": per["detokenize_stop"],
    }
    out["engine_other"] = (
        out["step_total"]
        - per.get("execute_total", 0.0)
        - sum(out[k] for k in ("scheduling", "sampling", "detokenize_stop"))
    )
    return {k: round(v, 3) for k, v in out.items()}
