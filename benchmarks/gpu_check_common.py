"""What the sections of benchmarks/gpu_check.py share: sizes, the report, time budgets, models,
prompts, transformers' reference generate and the engine's own counters (run that script)."""

from __future__ import annotations

import gc
import json
import os
import random
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from testkit.tiny_models import EOS_ID, save_random_model

EOS = EOS_ID  # id 0 of the tiny word tokenizer


@dataclass(frozen=True)
class Sizes:
    device: str
    archs: list[str]  # parity section: eager torch engine vs transformers, in this order (cut at the budget)
    triton_archs: list[str]
    triton_settings: list[str]
    compiled_archs: list[str]  # compiled and graphs sections
    compiled_setting: str  # PARITY_SETTINGS names of the compiled and graphs sections' engines
    graphs_setting: str
    parity_prompts: int  # of each half: random lengths 1-300, and a 96-token shared prefix + 0-60
    parity_settings: list[str]  # PARITY_SETTINGS names for the parity and triton sections
    big: dict[str, Any]  # LlamaConfig kwargs of the throughput model
    big_dtype: str  # its dtype, saved and run
    n_prompts: int
    prompt_lens: tuple[int, int]
    out_tokens: int
    hf_batches: list[int]
    shared_prefix: int
    sync_requests: int  # syncs section: requests per feature set, and decode steps profiled
    sync_steps: int
    estimate_s: dict[str, float]  # expected seconds per section (the docstring of gpu_check.py says why)
    budget_s: dict[str, float]  # the most a section may take: it stops its optional parts past this
    total_cap_s: float  # no section starts past this; each gets at most what is left of it
    hard_cap_s: float  # from the process's start: the run is stopped here, whatever it is doing
    engine: dict[str, Any] = field(default_factory=dict)  # extra settings of the throughput engines
    graph_backend: str = "auto"  # compiled/graphs sections (smoke: "triton", the one backend graphs replay over)
    graph_standin: bool = False  # smoke: CUDA graphs stood in for on the CPU (replay = rerun on static buffers)
    bf16_archs: list[str] = field(default_factory=list)  # bf16 section: the reduced-precision policy, in order
    bf16_prompts: int = 8  # its prompts (5-150 random tokens) and greedy tokens per prompt
    bf16_tokens: int = 16
    # syncs section, compiled_graphs config: the sampling features measured (None: every one). Why the
    # smoke takes fewer: each of its graph steps runs Triton's interpreter (~0.5 s a step on 2 cores)
    graph_sync_features: tuple[str, ...] | None = None


class Report:
    """The JSON document, rewritten whole (atomically) after every section and every unit of one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)


class Budget:
    """A section's time: what is left of its budget, and whether a unit of work still fits."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds, self.clock, self.start = seconds, clock, clock()

    def spent(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.seconds - self.spent()

    def allows(self, estimate_s: float = 0.0) -> bool:
        return self.left() >= estimate_s


def start_watchdog(
    report: Report,
    started: float,
    seconds: float,
    current: Callable[[], str | None],
    work: Path | None = None,
) -> threading.Event:
    """Past `seconds` from `started` (perf_counter), mark the running section cut, write the report,
    remove the scratch folder `work` (the saved models) and end the process (exit code 3).
    Why: a unit of work cannot be interrupted (a compile, a capture), so a budget alone cannot
    promise the run's length; this does. Setting the returned event stands it down."""
    done = threading.Event()

    def fire() -> None:
        if done.wait(max(0.0, started + seconds - time.perf_counter())):
            return
        name = current()
        if name is not None:
            out = report.data.setdefault(name, {})
            out.setdefault("cut", []).append(f"the run's hard cap ({seconds:.0f} s) stopped it here")
            out["status"] = "cut"
        report.data["hard_cap_reached"] = True
        for _ in range(20):  # why retried: the main thread may be changing the dicts being written
            try:
                report.write()
                break
            except RuntimeError:
                time.sleep(0.05)
        print(json.dumps({"hard_cap_reached": seconds, "section": name}), flush=True)
        sys.stderr.flush()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        os._exit(3)

    threading.Thread(target=fire, name="gpu_check-watchdog", daemon=True).start()
    return done


@dataclass
class Ctx:
    """One run: sizes, scratch folder, report, the current section's budget, and what sections share
    (saved models, reference tokens, compiled engines), keyed by name in `cache`."""

    sizes: Sizes
    work: Path
    report: Report
    budget: Budget = field(default_factory=lambda: Budget(float("inf")))
    cache: dict[str, Any] = field(default_factory=dict)
    script_syncs: int = 0  # torch.cuda.synchronize calls the script made (never the engine's)

    def save(self) -> None:
        self.report.write()

    def sync(self) -> None:
        """The script's own device sync, around timed windows: counted apart from the engine's."""
        if self.sizes.device == "cuda":
            torch.cuda.synchronize()
            self.script_syncs += 1

    def unit(self, out: dict[str, Any], name: str, estimate_s: float = 0.0) -> bool:
        """Whether the optional unit `name` fits the budget; when not, it is listed in out["cut"]."""
        if self.budget.allows(estimate_s):
            return True
        out.setdefault("cut", []).append(name)
        return False


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def save_model(config: Any, path: Path, device: str, dtype: torch.dtype | None = None) -> Path:
    """A random-weight model of `config` saved (in `dtype`) with its word tokenizer; memory freed after."""
    if not (path / "config.json").is_file():
        save_random_model(config, path, 0, device, dtype)
        free_memory()
    return path


def random_prompts(
    n: int, lens: tuple[int, int], vocab: int, seed: int, prefix: list[int] | None = None, token_seed: int | None = None
) -> list[list[int]]:
    """n prompts with lengths drawn from `seed`, tokens from `token_seed` (default `seed`): the same
    seed with another token_seed gives prompts of the same lengths (a warm-up of the same shapes)."""
    lengths = [random.Random(seed * 1009 + i).randint(*lens) for i in range(n)]
    tokens = random.Random(seed if token_seed is None else 7919 + token_seed)
    return [(prefix or []) + [tokens.randrange(1, vocab) for _ in range(k)] for k in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load_hf(path: Path, device: str, dtype: torch.dtype, attn: str) -> Any:
    """transformers' model with an explicit attention implementation.

    Why explicit: transformers 5's default is sdpa, which drops Gemma 2's attention logit
    soft-capping; the token-parity references load "eager", the exact one."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).to(device).eval()


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, device: str) -> list[list[int]]:
    """One left-padded greedy `generate` call (one prompt: no padding); EOS never stops it."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=EOS, eos_token_id=-1
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config)
    return [row[width:].tolist() for row in out.cpu()]


def tokens_of(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def compare(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """Token-for-token agreement of two runs' outputs."""
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    return {"matched": len(want) - len(bad), "of": len(want), "mismatched": bad[:10]}


# ----------------------------------------------------------------------------- engine counters


def engine_counters(llm: LLM) -> dict[str, Any]:
    """What the engine itself counts: steps, Transfers' uploads and reads (by site), graphs compiled,
    CUDA graphs captured and replayed. Never the script's own syncs (Ctx.script_syncs)."""
    runner = llm.engine.runner
    counts = runner.transfers.counts
    graphs = runner.graphs
    return {
        "steps": llm.engine.stats.steps,
        "decode_tokens": llm.engine.stats.decode_tokens,
        "uploads": counts.uploads,
        "reads": counts.reads,
        "read_sites": dict(counts.read_sites),
        "compiled_graphs": runner.forward.stats.graphs,
        "captures": None if graphs is None else getattr(graphs, "captures", None),
        "captures_after_start": None if graphs is None else getattr(graphs, "captures_after_start", None),
        "replays": None if graphs is None else getattr(graphs, "replays", None),
    }


def counters_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """after - before, and per engine step for uploads and reads."""
    delta: dict[str, Any] = {}
    for key, value in after.items():
        if isinstance(value, dict):
            delta[key] = {k: v - before[key].get(k, 0) for k, v in value.items() if v != before[key].get(k, 0)}
        elif value is None or before.get(key) is None:
            delta[key] = None
        else:
            delta[key] = value - before[key]
    steps = max(delta["steps"], 1)
    delta["reads_per_step"] = round(delta["reads"] / steps, 3)
    delta["uploads_per_step"] = round(delta["uploads"] / steps, 3)
    return delta
