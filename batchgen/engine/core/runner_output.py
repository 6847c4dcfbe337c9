"""What the model runner hands back for each step: the one result of the one call down.

vLLM v1's ModelRunnerOutput: with ScheduledBatch, the whole contract between loop and runner; host
data read in the step's one device->host copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class LogprobLists:
    """Logprobs of some rows, as read (sampling/logprobs.score's lists): row j scored `targets[j]`
    and asked for `ks[j]` alternatives."""

    rows: list[int]  # which rows: for sampled tokens, indices into the batch's draws
    ks: list[int]
    targets: list[int]
    read: list[Any]
    # prompt logprobs: per chunk (its sequence, its first position, its rows), in batch order; row j
    # of a chunk starting at `start` scores prompt token start + j + 1
    chunks: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """One step's results: `sampled[i]` is the token drawn for the batch's `draws[i]`."""

    sampled: list[int] = field(default_factory=list)
    nan: bool = False  # some logits row of the step held a NaN (the loop fails the step)
    logprobs: LogprobLists | None = None  # the draws that asked for logprobs
    prompt_logprobs: LogprobLists | None = None  # with its chunks
    grammar_done: frozenset[int] = frozenset()  # draws whose grammar has accepted a complete output
    errors: tuple[tuple[int, str], ...] = ()  # (seq id, why): requests failed in this step (an undecodable image)


EMPTY_OUTPUT = ModelRunnerOutput()
