"""The step loop: `Engine` (add requests, step, abort) and the output side of each request (texts,
stop checks, logprobs), the loop that runs a list of prompts to completion, and the counters.

Each step: the scheduler's output (core) -> the model runner's forward (runner) -> the sampler
(sampling) -> the scheduler takes the sampled tokens; finished requests become outputs.
"""
