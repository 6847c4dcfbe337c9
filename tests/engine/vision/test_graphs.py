"""CUDA-graph decode steps of vision-language models, on the CPU with only the capture stood in for
(tests/engine/test_cuda_graphs): decode steps replay from the static buffers, Qwen2-VL's M-RoPE
decode positions (index + the request's delta, three axes) staged into the graphs' rope buffer, and
the greedy tokens equal transformers' generate (float32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM, SamplingParams
from testkit.tiny_vision import image_prompts
from testkit.vision_reference import reference_tokens
from tests.engine.test_cuda_graphs import _ReplayByRerun
from tests.engine.vision.test_parity import MAX_TOKENS


@pytest.mark.parametrize("family", ["qwen2_vl", "llava"])
def test_graph_decode_steps_match_transformers(family: str, tiny_vlm: Callable[[str], Path]) -> None:
    folder = tiny_vlm(family)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, attention_backend="triton", max_num_seqs=2)
    assert llm._vision is not None
    runner = llm.engine.runner
    seen: list[set[int]] = []

    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        seen.append({t.untyped_storage().data_ptr() for t in tensors})
        return runner.forward(*tensors)

    max_blocks = -(-llm.config.max_model_len // runner.block_size)
    rope_axes = runner.model.rope_axes
    assert rope_axes == (3 if family == "qwen2_vl" else 0)
    graphs = _ReplayByRerun(forward, 2, max_blocks, runner.block_size, runner.device, rope_axes)
    graphs.capture_all(runner._graph_run, runner._graph_context)  # as the runner does when made on CUDA
    runner.graphs = graphs
    captured = len(seen)
    prompts = image_prompts(llm._vision.processor.placeholder)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    assert [o.outputs[0].token_ids for o in outs] == reference_tokens(llm, folder, prompts, MAX_TOKENS)
    assert len(seen) > captured + 5  # decode steps did replay
    buf = graphs.buffers
    static = {t.untyped_storage().data_ptr() for t in (buf.input_ids, buf.model_positions(2), buf.keep)}
    assert all(inputs <= static for inputs in seen)  # a replay reads nothing a step frees
    assert graphs.captures_after_start == 0
