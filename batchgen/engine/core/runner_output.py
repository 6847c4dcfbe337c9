"""What the model runner hands back for each step: the one result of the one call down.

Why a module of its own (vLLM v1's ModelRunnerOutput): with ScheduledBatch (scheduler_output) it
is the whole contract between the loop and the runner. `ModelRunner.execute(batch)` takes the
scheduler's snapshot and returns this; nothing below the loop calls back into it. Everything here
is host data, read in the step's one device->host copy: the drawn token ids, the NaN flag, and
the logprob values as read (the loop's output side turns them into outputs with token texts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LogprobLists:
    """Logprobs of some rows, as read: row j scored `targets[j]` and asked for `ks[j]` alternatives.

    `read` holds sampling/logprobs.score's lists (the targets' values and ranks, then the top-K
    values and ids when some K > 0); sampling/logprobs.entries turns them into outputs."""

    rows: list[int]  # which rows: for sampled tokens, indices into the batch's draws
    ks: list[int]
    targets: list[int]
    read: list[Any]


@dataclass(frozen=True)
class PromptLogprobLists:
    """A step's prompt logprobs: per chunk (its sequence, its first position, its rows), in batch
    order; row j of a chunk starting at `start` scores prompt token start + j + 1."""

    chunks: list[tuple[int, int, int]]
    scored: LogprobLists


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results: `sampled[i]` is the token drawn for the batch's `draws[i]`."""

    sampled: list[int] = field(default_factory=list)
    nan: bool = False  # some logits row of the step held a NaN (the loop fails the step)
    logprobs: LogprobLists | None = None  # the draws that asked for logprobs
    prompt_logprobs: PromptLogprobLists | None = None
    grammar_done: frozenset[int] = frozenset()  # draws whose grammar has accepted a complete output
    errors: tuple[tuple[int, str], ...] = ()  # (seq id, why): requests failed in this step (an undecodable image)


EMPTY_OUTPUT = ModelRunnerOutput()
