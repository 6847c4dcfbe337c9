"""The step loop: `Engine` (add requests, step, abort) and the output side of each request (texts,
stop checks, logprobs; `generate` runs a list of prompts to completion), and the counters.

Each step is one call down and one result back: the scheduler's output (core) -> the model
runner's `execute` (runner: forward, draw, one read) -> its ModelRunnerOutput -> the scheduler
takes the drawn tokens; finished requests become outputs.
"""
