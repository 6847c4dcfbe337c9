"""The progress bar: tok/s and rows move as requests finish (not per part), and the ETA follows
tokens, so a continuously batched run (rows finishing in bursts) shows a sane one. Simulated
runs use a fake clock: nothing here depends on how fast the machine is."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, ClassVar

import pytest

from batchgen.job.spec import load_job
from batchgen.run import progress
from batchgen.run.progress import RecentRate, RunProgress, eta_seconds, format_eta
from batchgen.run.runner import JobRunner
from tests.conftest import make_job, write_job, write_parquet


def _simulate(rows: int, slots: int, early: float, budget: int = 96, rate: float = 600.0) -> tuple[float, list]:
    """A continuously batched engine: `slots` rows run at once, each step makes one token per
    running row at `rate` tokens/s; a share `early` of the rows stops early (EOS), the rest runs
    to `budget`. Returns (when the job ends, [(time, rows done, ETA shown)] at every finish)."""
    rng = random.Random(0)
    lengths = [rng.randint(5, 40) if rng.random() < early else budget for _ in range(rows)]
    now, generated = [0.0], [0]
    bar = RunProgress(rows, True, live_tokens=lambda: generated[0], budget=budget, clock=lambda: now[0])
    waiting, running, seen = list(range(rows)), {}, []
    while waiting or running:
        while waiting and len(running) < slots:
            running[waiting.pop(0)] = 0
        now[0] += len(running) / rate
        generated[0] += len(running)
        for i in list(running):
            running[i] += 1
            if running[i] == lengths[i]:
                del running[i]
                bar.update(1, lengths[i])
                seen.append((now[0], bar.rows, bar.last_eta))
    return now[0], seen


@pytest.mark.parametrize(("rows", "slots", "early"), [(300, 256, 0.3), (2400, 256, 0.3), (2400, 256, 0.0)])
def test_the_eta_of_a_continuously_batched_run_is_sane_from_the_first_finished_row(
    rows: int, slots: int, early: float
) -> None:
    """The quickstart's shape: no row finishes for a while, then they come in bursts. tqdm's rows/s
    made "4:57:42" of a 9-minute job; the token-based ETA is within a factor of three of the truth
    (or a tenth of the job's length) from the first finished row on (it starts from the max_tokens
    bound, pessimistic; the first rows' mean, once trusted, is short: the early finishers stopped
    early), and off by less than a tenth of the whole job over its last half."""
    end, seen = _simulate(rows, slots, early)
    for now, done, eta in seen:
        left = end - now
        assert eta is not None
        close = abs(eta - left) <= end / 10
        assert close or left / 3 <= eta <= 3 * left, (now, done, eta, left)
        assert close or now < end / 2, (now, done, eta, left)


def test_the_eta_uses_the_finished_rows_mean_once_enough_have_finished() -> None:
    # 1000 rows, 100 done with 20 tokens each, 500 tokens in flight, 100 tok/s: 900 * 20 - 500
    assert eta_seconds(1000, 100, 2000, 2500, 100.0, budget=96) == pytest.approx(175.0)
    # 10 done (too few: the early finishers are the short ones): the max_tokens bound instead
    assert eta_seconds(1000, 10, 200, 700, 100.0, budget=96) == pytest.approx((990 * 96 - 500) / 100)
    assert eta_seconds(1000, 10, 200, 700, 100.0, budget=None) is None  # no bound known: no guess
    assert eta_seconds(1000, 100, 2000, 2500, None, budget=96) is None  # no rate yet
    assert eta_seconds(5, 5, 50, 50, 10.0, budget=96) == 0.0


def test_the_rate_is_recent_so_a_slow_start_fades_out() -> None:
    rate = RecentRate(window=30.0)
    assert rate.add(0.0, 0) is None
    for second in range(1, 61):  # a minute of loading and prefill: nothing generated
        rate.add(float(second), 0)
    for second in range(61, 121):  # then 100 tokens/s
        recent = rate.add(float(second), (second - 60) * 100)
    assert recent == pytest.approx(100.0, rel=0.05)


def test_eta_format() -> None:
    assert [format_eta(s) for s in (None, 0.2, 65, 9 * 60 + 3, 4 * 3600)] == [
        "ETA ?",
        "ETA 0:00:00",
        "ETA 0:01:05",
        "ETA 0:09:03",
        "ETA 4:00:00",
    ]


class _RecordingBar:
    """Stands in for tqdm: records (rows shown, postfix) at every update."""

    seen: ClassVar[list[tuple[int, str]]] = []

    def __init__(self, total: int, **_: Any) -> None:
        self.total, self.n, self.postfix = total, 0, ""

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        _RecordingBar.seen.append((self.n, self.postfix))

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_one_part_job_shows_rows_and_tok_s_as_requests_finish(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """tok/s used to be set per part: a one-part job showed it only at 100%."""
    monkeypatch.setattr(progress, "tqdm", _RecordingBar)
    monkeypatch.setattr(_RecordingBar, "seen", [])
    rows = 12
    data = write_parquet(
        tmp_path / "in.parquet",
        {"id": [str(i) for i in range(rows)], "prompt": [f"once upon a time {'cat ' * (i % 4)}" for i in range(rows)]},
    )
    job = make_job(
        tiny_model_dir,
        str(data),
        tmp_path / "out",
        engine={"backend": backend, "window_rows": 100, "batch_size": 4},
        sampling={"max_tokens": 6},
    )
    JobRunner(load_job(write_job(tmp_path / "job.yaml", job))).run()
    seen = _RecordingBar.seen
    assert [n for n, _ in seen if n] == list(range(1, rows + 1))  # one update per finished row
    before_the_end = [postfix for n, postfix in seen if 0 < n < rows]
    assert before_the_end and all(" tok/s, ETA " in postfix for postfix in before_the_end), seen
    assert all(float(postfix.split(" tok/s")[0]) > 0 for postfix in before_the_end), seen


def test_the_engines_load_shows_a_ticking_status_line_unless_quiet(capsys: pytest.CaptureFixture[str]) -> None:
    """Minutes of kernel builds on a fresh machine read as what they are, with the time so far."""
    import time

    with progress.LoadingStatus("building native CPU kernels", quiet=False, tick=0.05):
        time.sleep(0.3)
    err = capsys.readouterr().err
    assert err.count("building native CPU kernels") >= 3  # refreshed while it ran
    with progress.LoadingStatus("building native CPU kernels", quiet=True, tick=0.05):
        time.sleep(0.1)
    assert capsys.readouterr().err == ""


def test_a_cpu_job_whose_kernels_are_not_built_says_it_builds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchgen.engine.cpu import native

    job = make_job(tmp_path, str(tmp_path / "in.parquet"), tmp_path / "out", engine={"backend": "native"})
    spec = load_job(write_job(tmp_path / "job.yaml", {**job, "model": {"path": str(tmp_path), "device": "cpu"}}))
    monkeypatch.setattr(native, "pending", lambda: ["attention", "linear"])
    assert progress.loading_what(spec).startswith("building native CPU kernels (2;")
    monkeypatch.setattr(native, "pending", lambda: [])
    assert progress.loading_what(spec) == "loading the model"
    hf = load_job(write_job(tmp_path / "hf.yaml", {**job, "engine": {"backend": "hf"}}))
    assert progress.loading_what(hf) == "loading the model"
