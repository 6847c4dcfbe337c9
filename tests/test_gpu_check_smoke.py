"""The prepared GPU check (benchmarks/gpu_check.py) in its CPU --smoke mode, so it cannot rot unseen.

It runs as a script in a subprocess where the packages the GPU image lacks (pydantic, ray,
xgrammar, ...) cannot be imported, with the Triton backend in its interpreter; every section must
produce its figures, and its checks (token parity, no recompile or capture while timing) must hold.
The plumbing (budgets, cuts, statuses, folded warnings, --sections) is tested here directly.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check_common import Budget, Ctx, Report
from benchmarks.gpu_check_quiet import Quiet
from tests.shared_setup import once

REPO = Path(__file__).resolve().parents[1]
NOT_ON_THE_GPU_IMAGE = ("pydantic", "pydantic_core", "ray", "xgrammar", "jsonschema", "boto3", "moto")

# why sys.modules[name] = None: `import name` then fails as on the GPU image, while find_spec(name)
# answers None (not installed); a meta-path finder that raises broke transformers' checks for
# optional packages once accelerate was installed
RUNNER = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
script, out = sys.argv[2], sys.argv[3]
sys.argv = [script, "--smoke", "--out", out]
runpy.run_path(script, run_name="__main__")
"""


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The smoke run's report (and its stderr as "_stderr"): one run per test run, whichever xdist
    workers this module's tests land on (see tests/shared_setup.py; the run takes ~45 s)."""

    def run(tmp: Path) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "TRITON_INTERPRET": "1",
        }
        args = [
            sys.executable,
            "-c",
            RUNNER,
            ",".join(NOT_ON_THE_GPU_IMAGE),
            str(REPO / "benchmarks/gpu_check.py"),
            str(tmp / "smoke.json"),
        ]
        proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        (tmp / "stderr.txt").write_text(proc.stderr)

    tmp = once(tmp_path_factory, "gpu_check", run)
    report: dict[str, Any] = json.loads((tmp / "smoke.json").read_text())
    report["_stderr"] = (tmp / "stderr.txt").read_text()
    return report


@pytest.mark.slow
def test_every_section_runs_without_the_packages_the_gpu_image_lacks(smoke: dict[str, Any]) -> None:
    statuses = {name: smoke[name]["status"] for name in gpu_check.SECTION_NAMES}
    assert statuses == {**dict.fromkeys(gpu_check.SECTION_NAMES, "ok"), "triton": statuses["triton"]}, statuses
    triton = smoke["triton"]
    if statuses["triton"] == "skipped":  # until the Triton backend is merged: the engine's refusal, named
        assert triton["skipped"].startswith("attention_backend 'triton' not available: ")
    else:
        assert statuses["triton"] == "ok" and triton["all_matched"] and triton["llama"]
    assert smoke["plan"]["estimate_total_s"] > 0 and set(smoke["plan"]["budget_s"]) == set(gpu_check.SECTION_NAMES)
    assert smoke["warnings"]["total"] >= 0 and smoke["script_syncs"] == 0  # CPU: the script never syncs


@pytest.mark.slow
def test_env_records_the_kernels_of_each_call_shape(smoke: dict[str, Any]) -> None:
    env0 = smoke["env"]
    assert env0["path_choice"]["bfloat16/block256"]["path"] == "sdpa"  # CPU: never the varlen kernel
    assert env0["backends"]["auto"]["resolves_to"] == "cpu"
    shapes = env0["observed"]["float32/block16"]["shapes"]
    assert set(shapes) == {"prefill", "continuation", "decode", "mixed"}
    sdpa, kernel = (
        {n for n, s in shapes.items() if any(k in op for op in s["ops"])}
        for k in ("scaled_dot", "native_decode_attention")
    )
    # CPU float32: prompts through SDPA, decodes over the decode rows in the native kernel
    assert sdpa == {"prefill", "continuation", "mixed"} and kernel == {"decode", "mixed"}


@pytest.mark.slow
def test_parity_compiled_and_graph_paths_match_transformers_and_eager_torch(smoke: dict[str, Any]) -> None:
    parity = smoke["parity"]
    assert parity["all_matched"] and parity["reference_attention"] == "eager"
    assert set(parity["llama"]) == set(parity["gemma2"]) == {"pressure", "relaxed"}
    for section in ("compiled", "graphs"):
        row = smoke[section]["llama"]
        for ref in ("vs_transformers", "vs_eager_torch"):
            assert row[ref]["matched"] == row[ref]["of"] == 6, (section, ref, row[ref])
        assert row["still_compiled"] and row["compiled_graphs_total"] >= 1
    assert smoke["compiled"]["llama"]["counters"]["replays"] is None  # graphs held off
    graphs = smoke["graphs"]["llama"]["counters"]
    assert graphs["replays"] > 0  # decode steps really went through graphs
    assert graphs["captures"] == graphs["captures_after_start"] == 0  # every one was captured before the run


@pytest.mark.slow
def test_bf16_meets_the_reduced_precision_policy(smoke: dict[str, Any]) -> None:
    bf16 = smoke["bf16"]
    assert bf16["all_met"] and bf16["prompts"] == gpu_check.SMOKE.bf16_prompts
    llama = bf16["llama"]
    assert llama["ok"] and not llama["failures"] and len(llama["greedy"]) == gpu_check.SMOKE.bf16_prompts
    assert llama["clear_positions"] > 0 and llama["prompt"].startswith("prompt logprobs: top-1 agrees")


def test_the_full_plan_fits_the_cap() -> None:
    """Every section's estimate within the H200 run's cap, on one GPU (tp skipped: it reserves nothing)
    and on two (tp runs)."""
    full = gpu_check.FULL
    one, two = (gpu_check.plan(gpu_check.for_gpus(full, n), gpu_check.SECTION_NAMES) for n in (1, 2))
    assert one["estimate_total_s"] == two["estimate_total_s"] - full.estimate_s["tp"]
    assert two["estimate_total_s"] <= full.total_cap_s < full.hard_cap_s


@pytest.mark.slow
def test_throughput_times_no_recompile_and_no_capture(smoke: dict[str, Any]) -> None:
    tp = smoke["throughput"]
    assert tp["hf_generate"]["best_batch_size"] == 6 and tp["hf_generate"]["output_tok_s"] > 0
    for name in ("eager", "compiled"):
        run = tp[name]
        assert run["stats"]["output_tokens"] == 6 * 5 and run["timing_clean"] and run["over_hf_best"] > 0
        timed = run["engine_counters_timed"]
        assert timed["compiled_graphs"] == 0 and not timed["captures"] and timed["reads_per_step"] > 0
    compiled = tp["compiled"]
    assert compiled["compiled"] and compiled["cuda_graphs"]  # the CPU stand-in's graphs
    warmup, timed = compiled["engine_counters_warmup"], compiled["engine_counters_timed"]
    # graphs were captured when the engine was made: none in the warm-up, none timed
    assert warmup["compiled_graphs"] >= 1 and warmup["captures"] == 0 and timed["replays"] > 0
    shared = tp["shared_prefix"]
    assert shared["engine_eager"]["stats"]["cached_tokens"] > 0 and shared["over_hf"] > 0


@pytest.mark.slow
def test_syncs_are_the_engines_own_per_decode_step(smoke: dict[str, Any]) -> None:
    syncs = smoke["syncs"]
    every = {"greedy", "top_p_top_k", "seeded_and_unseeded", "logprobs", "penalties", "n2", "all"}
    assert set(gpu_check.SMOKE.graph_sync_features or ()) < every  # (the smoke's graph steps are interpreted)
    for config, measured in (("eager", every), ("compiled_graphs", set(gpu_check.SMOKE.graph_sync_features or ()))):
        features = syncs[config]["features"]
        assert set(features) == measured
        greedy = features["greedy"]
        assert greedy["shapes"] == ["decode"] and greedy["engine"]["reads_per_step"] == 1.0
        assert greedy["profiler_syncs_per_step"] is None  # CPU: no device syncs to count
    assert syncs["compiled_graphs"]["features"]["greedy"]["engine"]["replays"] == gpu_check.SMOKE.sync_steps


# ----------------------------------------------------------------------------- plumbing, no subprocess


def test_budget_cuts_optional_units_and_lists_them(tmp_path: Path) -> None:
    now = [0.0]
    ctx = Ctx(gpu_check.SMOKE, tmp_path, Report(tmp_path / "r.json"), Budget(10.0, clock=lambda: now[0]))
    out: dict[str, Any] = {}
    assert ctx.unit(out, "a", 4.0)
    now[0] = 7.0
    assert not ctx.unit(out, "b", 4.0) and ctx.unit(out, "c", 3.0)
    assert out == {"cut": ["b"]} and gpu_check.status_of(out) == "cut"
    assert gpu_check.status_of({"failures": ["x"], "cut": ["b"]}) == "failed"
    assert gpu_check.status_of({"error": "E", "failures": ["x"]}) == "error"
    assert gpu_check.status_of({"skipped": "why"}) == "skipped" and gpu_check.status_of({}) == "ok"


def test_a_section_gets_its_budget_less_what_the_later_sections_need_before_the_cap() -> None:
    one_gpu = gpu_check.for_gpus(gpu_check.FULL, 1)  # one H200: the tp section is skipped at once
    names = gpu_check.SECTION_NAMES
    assert gpu_check.section_time(one_gpu, names, 0.0) == one_gpu.budget_s["env"]  # room for all
    sizes = gpu_check.FULL  # two GPUs: tp's estimate is reserved too
    later = sum(sizes.estimate_s[n] for n in names[-2:][1:])
    late = sizes.total_cap_s - later - 1.0  # the next to last starts with 1 s of room before throughput's share
    assert gpu_check.section_time(sizes, names[-2:], late) == 0.5 * sizes.estimate_s[names[-2]]
    assert gpu_check.section_time(sizes, names[-1:], sizes.total_cap_s - 60.0) == 60.0  # the last: what is left


def test_sections_keep_their_order_and_unknown_ones_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.parse(["--sections", "syncs,env"]).sections == ["env", "syncs"]
    with pytest.raises(SystemExit):
        gpu_check.parse(["--sections", "env,bogus"])
    assert "bogus" in capsys.readouterr().err


def test_a_section_that_raises_keeps_what_it_recorded_and_the_report_is_written(tmp_path: Path) -> None:
    ctx = Ctx(gpu_check.SMOKE, tmp_path, Report(tmp_path / "r.json"))

    def section(ctx: Ctx, out: dict[str, Any]) -> None:
        out["first"] = 1
        ctx.save()
        raise RuntimeError("boom")

    gpu_check.run_section(ctx, "env", section, 5.0)
    written = json.loads((tmp_path / "r.json").read_text())["env"]
    assert written["first"] == 1 and written["status"] == "error" and "boom" in written["error"]


def test_warnings_and_log_lines_print_once_per_kind_and_are_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers.utils import logging as tf_logging

    for name in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):  # restored after the test
        monkeypatch.setenv(name, "1")
    stream = (tmp_path / "err.txt").open("w")
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, warnings.showwarning, warnings.filters[:])
    verbosity = tf_logging.get_verbosity()
    # why: the check runs in a fresh process, where transformers warns; a CLI run earlier in this
    # test process (batchgen's own, through CliRunner) may have set it to errors only
    tf_logging.set_verbosity_warning()
    try:
        quiet = Quiet(stream)
        quiet.install()
        for _ in range(50):
            warnings.warn("same thing", UserWarning, stacklevel=1)
            logging.getLogger("transformers.generation").warning("pad token %s", "again")
        logging.getLogger("gpu_check").info("own line")
        logging.getLogger("gpu_check").info("own line")
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        warnings.showwarning, warnings.filters[:] = saved[2], saved[3]
        tf_logging.enable_default_handler()
        tf_logging.disable_propagation()
        tf_logging.enable_progress_bar()
        tf_logging.set_verbosity(verbosity)
        stream.close()
    text = (tmp_path / "err.txt").read_text()
    assert text.count("same thing") == 1 and text.count("pad token again") == 1 and text.count("own line") == 2
    assert quiet.summary()["total"] == 100 and set(quiet.summary()["kinds"].values()) == {50}


WATCHDOG = """
import sys, time
from pathlib import Path
from benchmarks.gpu_check_common import Report, start_watchdog
report = Report(Path(sys.argv[1]))
report.data["env"] = {"first": 1}
start_watchdog(report, time.perf_counter(), 0.5, lambda: "env")
time.sleep(60)  # a unit of work that no budget check can interrupt (a compile, a capture)
"""


@pytest.mark.slow
def test_the_hard_cap_stops_the_run_and_writes_what_it_had(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", WATCHDOG, str(out)], env=env, capture_output=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["hard_cap_reached"] and report["env"]["status"] == "cut" and report["env"]["first"] == 1


def test_the_tp_section_says_why_it_is_skipped_on_one_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Today's GPU machine has one GPU: the section records the count and the reason, and runs nothing."""
    import torch

    from benchmarks import gpu_check_tp

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ctx = Ctx(gpu_check.FULL, tmp_path, Report(tmp_path / "r.json"))
    out: dict[str, Any] = {}
    gpu_check_tp.section_tp(ctx, out)
    assert out["gpus"] == 1 and "needs 2 or more" in out["skipped"] and gpu_check.status_of(out) == "skipped"
    assert not list(tmp_path.iterdir())  # no model saved, no engine made


def test_a_sync_outside_transfers_fails_the_syncs_section() -> None:
    """The rule that caught the penalties' hidden sync on the first H200 run: more stream syncs per
    step in the profiler than the engine's own reads is a failure; equal counts, or no profiler
    figures (the CPU), are not."""
    from benchmarks.gpu_check_syncs import hidden_syncs

    def row(syncs: float | None, reads: float) -> dict[str, Any]:
        calls = None if syncs is None else {"cudaStreamSynchronize": syncs, "cudaDeviceSynchronize": 0.12}
        return {"profiler_calls_per_step": calls, "engine": {"reads_per_step": reads}}

    assert "outside Transfers" in (hidden_syncs(row(2.0, 1.0)) or "")
    assert hidden_syncs(row(1.0, 1.0)) is None
    assert hidden_syncs(row(None, 1.0)) is None
