"""The systems under test, each timed on a whole workload: batchgen's engine and transformers' two paths.

- native: `LLM.generate` (paged KV, continuous batching, prefix caching on or off).
- hf_generate: transformers `generate`, static left-padded batches of one size, prompts sorted
  by length first (what a careful user does: it minimises padding; output lengths are unknown
  up front); a batch runs until its longest request is done.
- hf_generate_batch: transformers' continuous batching (the manager behind `generate_batch`),
  fed request by request so each gets its own `max_new_tokens` (`generate_batch` itself takes
  one for all, which would bill every request for the longest).
Every run is greedy. Output tokens count only what each request asked for: for stop-string
workloads, tokens up to and including the stop (found with the engine's own StopChecker).
Model loading, KV pool allocation and a short warm-up are outside the timed region.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig, GenerationConfig

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.sampling.stopping import StopChecker
from benchmarks.workloads import Request, Workload

MAX_NUM_SEQS = 64  # seats per step, the same for the engine and generate_batch
MAX_BATCHED_TOKENS = 2048  # tokens per step, the same for the engine and generate_batch


@dataclass
class RunResult:
    system: str
    seconds: float
    output_tokens: int  # tokens the requests asked for (see module docstring)
    prompt_tokens: int
    prefill_tokens: int | None  # tokens actually run as prefill (padding and recomputation included)
    preemptions: int | None
    peak_rss_mib: float
    outputs: list[list[int]] = field(repr=False, default_factory=list)  # per request, in order
    extra: dict[str, Any] = field(default_factory=dict)
    # why: the machine is shared; a run next to someone else's job shows here (see Stopwatch)
    cpu_wait: float | None = None


def reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS, so each run gets its own peak."""
    # If it cannot, peaks accumulate over the process; the table says peaks are process-wide.
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _cpu_wait_seconds() -> float | None:
    """Seconds, since boot, that some task waited for a CPU (Linux pressure stall information)."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    match = re.search(r"total=(\d+)", line)
    return int(match.group(1)) / 1e6 if match else None


class Stopwatch:
    """One run's timed region: wall seconds, and the share of them some task waited for a CPU.

    This process's own threads fit the cores, so a share well above zero means someone else was
    running too and the figure is suspect. Starting it also resets the peak-RSS mark.
    """

    def __init__(self) -> None:
        reset_peak_rss()
        self._wait = _cpu_wait_seconds()
        self._start = time.perf_counter()

    def stop(self) -> tuple[float, float | None]:
        seconds = time.perf_counter() - self._start
        wait = _cpu_wait_seconds()
        share = None if wait is None or self._wait is None else round((wait - self._wait) / seconds, 3)
        return seconds, share


def peak_rss_mib() -> float:
    match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(match.group(1)) / 1024 if match else float("nan")


def useful_tokens(tokenizer: Any, request: Request, tokens: list[int], eos: list[int], ignore_eos: bool) -> int:
    """How many of `tokens` the request asked for: up to EOS / stop string / max_tokens."""
    if ignore_eos and not request.stop:
        return min(len(tokens), request.max_tokens)
    params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, stop=request.stop, ignore_eos=ignore_eos)
    checker = StopChecker(tokenizer, params, eos, request.prompt_ids)
    for i, token in enumerate(tokens):
        if checker.append(token):
            return i + 1
    return len(tokens)


def _params(workload: Workload) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=workload.ignore_eos, stop=r.stop)
        for r in workload.requests
    ]


def run_native(
    path: Path,
    workload: Workload,
    prefix_caching: bool = True,
    name: str = "native",
    compile: bool | str = "auto",
    dtype: str = "float32",
) -> RunResult:
    """batchgen's LLM.generate over the whole workload. Compiling (engine.compile) happens in the
    warm-up, outside the timed region; its seconds are reported in the row's extra fields."""
    llm = LLM(
        str(path),
        device="cpu",
        dtype=dtype,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        enable_prefix_caching=prefix_caching,
        compile=compile,
    )
    # why two sizes: dynamo traces the first call with static shapes, the second makes them dynamic
    for n in (2, 3):
        llm.generate([[5, 6, 7, 8]] * n, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    compiled = llm.engine.runner.forward.stats.as_dict()
    before = llm.stats
    watch = Stopwatch()
    outs = llm.generate([r.prompt_ids for r in workload.requests], _params(workload))
    seconds, cpu_wait = watch.stop()
    after = llm.stats
    delta = {k: after[k] - before[k] for k in after}
    return RunResult(
        system=name,
        seconds=seconds,
        output_tokens=sum(o.num_output_tokens for o in outs),
        prompt_tokens=workload.prompt_tokens,
        prefill_tokens=delta["prefill_tokens"],
        preemptions=delta["preemptions"],
        peak_rss_mib=peak_rss_mib(),
        outputs=[list(o.outputs[0].token_ids) for o in outs],
        extra={
            "cached_tokens": delta["cached_tokens"],
            "steps": delta["steps"],
            **compiled,
            "compiled_graphs_in_run": llm.engine.runner.forward.stats.graphs - compiled["compiled_graphs"],
            "native_linears": llm.native_linears,
        },
        cpu_wait=cpu_wait,
    )


def load_hf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


def _eos(model: Any) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def static_batch(model: Any, tokenizer: Any, requests: list[Request], ignore_eos: bool) -> tuple[list[list[int]], int]:
    """One left-padded `generate` call -> (new tokens per request, prefill tokens incl. padding)."""
    pad = model.generation_config.pad_token_id
    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.full((len(requests), width), pad, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, r in enumerate(requests):
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    stops = sorted({s for r in requests for s in r.stop})
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in requests),
        pad_token_id=pad,
        # why -1, not None: None falls back to the model's generation_config EOS and stops there
        eos_token_id=-1 if ignore_eos else _eos(model),
        stop_strings=stops or None,
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, generation_config=config, tokenizer=tokenizer if stops else None
        )
    new = out[:, width:].tolist()
    return new, len(requests) * width


def run_hf_generate(model: Any, tokenizer: Any, workload: Workload, batch_size: int) -> RunResult:
    """transformers `generate` in static batches of `batch_size`, prompts sorted by length."""
    reqs = workload.requests
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i].prompt_ids))
    outputs: list[list[int]] = [[] for _ in reqs]
    prefill = 0
    watch = Stopwatch()
    for b in range(0, len(order), batch_size):
        rows = order[b : b + batch_size]
        new, computed = static_batch(model, tokenizer, [reqs[i] for i in rows], workload.ignore_eos)
        prefill += computed
        for i, tokens in zip(rows, new):
            outputs[i] = tokens
    seconds, cpu_wait = watch.stop()
    return _hf_result(
        f"hf_generate_bs{batch_size}",
        (seconds, cpu_wait),
        workload,
        outputs,
        tokenizer,
        _eos(model),
        prefill,
        {"batch_size": batch_size},
    )


def _hf_result(
    name: str,
    timing: tuple[float, float | None],
    workload: Workload,
    outputs: list[list[int]],
    tokenizer: Any,
    eos: list[int],
    prefill: int | None,
    extra: dict[str, Any],
) -> RunResult:
    seconds, cpu_wait = timing
    counts = [useful_tokens(tokenizer, r, o, eos, workload.ignore_eos) for r, o in zip(workload.requests, outputs)]
    return RunResult(
        system=name,
        seconds=seconds,
        output_tokens=sum(counts),
        prompt_tokens=workload.prompt_tokens,
        prefill_tokens=prefill,
        preemptions=None,
        peak_rss_mib=peak_rss_mib(),
        outputs=[o[:n] for o, n in zip(outputs, counts)],
        extra=extra,
        cpu_wait=cpu_wait,
    )


def _cb_config(workload: Workload, page_size: int) -> ContinuousBatchingConfig:
    # why explicit sizes: on CPU its defaults size the cache from total RAM (tens of GB of zeros)
    pages_per_request = -(-workload.max_total_len // page_size)
    return ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=2 * MAX_NUM_SEQS * pages_per_request,
        max_batch_tokens=MAX_BATCHED_TOKENS,
        max_requests_per_batch=MAX_NUM_SEQS,
        allow_block_sharing=True,
        use_cuda_graph=False,
        auto_switch_to_flash=False,
    )


def run_hf_generate_batch(model: Any, tokenizer: Any, workload: Workload, page_size: int = 256) -> RunResult:
    """transformers' continuous batching, one request per prompt with its own max_new_tokens."""
    eos = _eos(model)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(r.max_tokens for r in workload.requests),
        pad_token_id=model.generation_config.pad_token_id,
        eos_token_id=eos or -1,
    )
    manager = model.init_continuous_batching(
        generation_config=config, continuous_batching_config=_cb_config(workload, page_size)
    )
    manager.warmup()
    manager.start()
    try:
        watch = Stopwatch()
        ids = [
            manager.add_request(
                r.prompt_ids,
                request_id=f"r{i}",
                max_new_tokens=r.max_tokens,
                eos_token_id=-1 if workload.ignore_eos else eos,
            )
            for i, r in enumerate(workload.requests)
        ]
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread died")
        timing = watch.stop()
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    outputs = [done[i] for i in ids]
    return _hf_result("hf_generate_batch", timing, workload, outputs, tokenizer, eos, None, {"page_size": page_size})
