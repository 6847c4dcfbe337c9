"""The run's progress bar: rows and output tokens/s updated as each request finishes, and an ETA
worked out from tokens.

Why not tqdm's own rate and ETA: rows of a continuously batched engine finish in bursts (none for
the first max_tokens steps, then many at once), so a rows/s rate smoothed from the first finishes
put "4:57:42" on a 9-minute job. What stays steady is the engine's output tokens/s; the tokens
still to generate are the rows not yet finished times the mean output tokens of the finished
ones, less what running requests have already generated (where the engine tells: `live_tokens`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType

from tqdm import tqdm

from batchgen.job.spec import JobSpec

MEAN_AFTER_ROWS = 32  # the finished rows' mean is trusted after this many, and 5% of the rows
RATE_WINDOW_SECONDS = 30.0  # "recent" tok/s: over about this long, so a slow start fades out
# tqdm's bar without its own rate and ETA; ours follow in the postfix ("..., 512 tok/s, ETA 0:01:05")
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"


class RecentRate:
    """Tokens per second over the last RATE_WINDOW_SECONDS (over all the time seen, while shorter)."""

    def __init__(self, window: float = RATE_WINDOW_SECONDS) -> None:
        self.window = window
        self.samples: deque[tuple[float, int]] = deque()  # (time, tokens so far), oldest first

    def add(self, now: float, tokens: int) -> float | None:
        """Record `tokens` generated so far at `now`; the recent rate, None until time has passed."""
        self.samples.append((now, tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window:
            self.samples.popleft()  # why keep one older than the window: the span never drops below it
        then, before = self.samples[0]
        return (tokens - before) / (now - then) if now > then else None


def eta_seconds(
    total_rows: int, done_rows: int, done_tokens: int, generated: int, rate: float | None, budget: int | None
) -> float | None:
    """Seconds left: the tokens the unfinished rows still need, over the recent rate.

    `done_tokens`: output tokens of the `done_rows` finished rows; `generated`: every token made so
    far, running requests' included (equal to done_tokens where the engine does not say);
    `budget`: the most tokens a row may generate (max_tokens), or None.

    Per unfinished row, the finished rows' mean once enough have finished; before that, and
    whenever the mean is already used up by what running rows generated, the budget: the first
    rows to finish are the ones that stopped early, so their mean alone would promise too soon."""
    unfinished = total_rows - done_rows
    if unfinished <= 0:
        return 0.0
    if not rate or rate <= 0:
        return None
    in_flight = max(generated - done_tokens, 0)
    enough = done_rows >= max(MEAN_AFTER_ROWS, total_rows // 20)
    remaining = unfinished * done_tokens / done_rows - in_flight if enough else -1.0
    if remaining <= 0 and budget is not None:
        remaining = unfinished * budget - in_flight
    return max(remaining, 0.0) / rate if remaining > 0 or budget is not None else None


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA ?"
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"ETA {hours}:{minutes:02d}:{secs:02d}"


def row_token_budget(spec: JobSpec, max_model_len: int | None = None) -> int | None:
    """The most output tokens one row may take, all samples together: the ETA's bound."""
    per_sample = spec.sampling.max_tokens if spec.sampling.max_tokens is not None else max_model_len
    return None if per_sample is None else per_sample * spec.sampling.n


class RunProgress:
    """The bar of one run (or of a Ray driver): rows finished, output tok/s of this run, ETA.
    Disabled (`quiet`): nothing is printed, the counts are still kept."""

    def __init__(
        self,
        total_rows: int,
        quiet: bool,
        live_tokens: Callable[[], int] | None = None,
        budget: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total_rows = total_rows
        self.budget = budget  # the most output tokens a row may take (see eta_seconds)
        self.bar = tqdm(total=total_rows, unit="row", disable=quiet, dynamic_ncols=True, bar_format=BAR_FORMAT)
        self.live_tokens = live_tokens
        self.base = live_tokens() if live_tokens is not None else 0  # why: the engine counts since it loaded
        self.clock = clock
        self.rate = RecentRate()
        self.rate.add(clock(), 0)
        self.rows = 0
        self.tokens = 0  # output tokens of the finished rows
        self.extra = ""  # e.g. "2 workers" on a Ray driver
        self.last_rate: float | None = None  # what the bar shows now (tok/s, seconds left)
        self.last_eta: float | None = None

    def update(self, n: int = 1, tokens: int = 0) -> None:
        """`n` more rows finished, with `tokens` output tokens between them (0 for error rows)."""
        self.show(self.rows + n, self.tokens + tokens)

    def show(self, rows: int, tokens: int, generated: int | None = None) -> None:
        """Set the totals so far: rows finished, their output tokens, and every token generated
        (running requests' included: a Ray driver adds what its workers report)."""
        self.rows, self.tokens = min(rows, self.total_rows), tokens
        if generated is None:
            generated = self.live_tokens() - self.base if self.live_tokens is not None else tokens
        rate = self.rate.add(self.clock(), max(generated, tokens))
        eta = eta_seconds(self.total_rows, self.rows, tokens, max(generated, tokens), rate, self.budget)
        self.last_rate, self.last_eta = rate, eta
        shown = [f"{rate:.0f} tok/s", format_eta(eta)] if rate is not None and self.rows else []
        self.bar.set_postfix_str(", ".join([*shown, self.extra] if self.extra else shown), refresh=False)
        self.bar.update(self.rows - self.bar.n)

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.bar.close()


class LoadingStatus:
    """One line while the engine loads, with the time it has taken so far (ticking every second), so
    that minutes of kernel builds on a fresh machine read "building native CPU kernels", not a
    silent stall. Disabled (`quiet`): nothing is printed."""

    def __init__(self, what: str, quiet: bool, tick: float = 1.0) -> None:
        self.bar = tqdm(total=None, desc=what, disable=quiet, bar_format="{desc} [{elapsed}]")
        self.quiet, self.tick = quiet, tick
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._refresh, daemon=True)

    def _refresh(self) -> None:
        while not self.done.wait(self.tick):
            self.bar.refresh()

    def __enter__(self) -> LoadingStatus:
        if not self.quiet:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
        self.bar.close()


def loading_what(spec: JobSpec) -> str:
    """What the engine's load will do first: build the native CPU kernels (once per machine), or load the model."""
    if spec.engine.backend != "native" or spec.model.device not in ("auto", "cpu"):
        return "loading the model"
    import torch

    from batchgen.engine.platforms import platform_for

    on_cpu = spec.model.device == "cpu" or not torch.cuda.is_available()
    missing, how_long = platform_for("cpu").pending_kernels() if on_cpu else ([], "")
    if missing:
        return f"building native CPU kernels ({len(missing)}; once per machine, {how_long})"
    return "loading the model"
