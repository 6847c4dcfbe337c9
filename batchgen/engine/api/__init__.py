"""The engine as its users see it: `LLM`, `SamplingParams`, `RequestOutput`, the engine settings.

Everything a caller passes in or gets back is defined here (vLLM-style names); nothing here runs
a model. `LLM` assembles the rooms below it: core (the step loop), sampling, runner, attention.
"""
