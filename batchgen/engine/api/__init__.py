"""The engine's contracts with its callers: `SamplingParams`, `RequestOutput`, the engine settings.

Everything a caller passes in or gets back is defined here (vLLM-style names), and every room
below reads them; nothing here runs a model. `LLM` (batchgen/engine/llm.py) stands above the
rooms and assembles them: core (the step loop), sampling, runner, attention.
"""
