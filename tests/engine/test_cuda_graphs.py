"""The CPU-testable parts of CUDA-graph decode: buckets, static-buffer padding, the fixed-shape
decode attention, and the KV store's skipping of padded slots (-1). Capture and replay need CUDA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention.kv_store import PAD_SLOT, pool_blocks, store_kv
from batchgen.engine.attention.static_decode import static_decode_attention
from batchgen.engine.cuda.graphs import (
    MIN_GRAPH_BLOCKS,
    DecodeBuffers,
    DecodeGraphs,
    GraphDecode,
    GraphKey,
    decode_buckets,
    pick_bucket,
    pick_width,
)
from batchgen.engine.llm import LLM
from batchgen.engine.runner.compiled_forward import bucket


def test_decode_buckets_and_choice() -> None:
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(3) == [1, 2, 3]
    buckets = decode_buckets(64)
    assert [pick_bucket(n, buckets) for n in (1, 3, 5, 17, 64)] == [1, 4, 8, 32, 64]
    assert pick_bucket(65, buckets) is None  # runs without a graph


def test_static_gather_width_follows_the_longest_row_not_the_model_length() -> None:
    max_blocks = 2048  # a 32k-token model at 16-token blocks
    assert MIN_GRAPH_BLOCKS == 16
    assert [pick_width(n, max_blocks) for n in (1, 16, 17, 40, 64, 65, 2000)] == [16, 16, 32, 64, 64, 128, 2048]
    assert pick_width(5, 8) == 8  # never wider than the longest sequence the engine allows
    buf = DecodeBuffers(max_batch=8, max_blocks=64, device=torch.device("cpu"))
    assert buf.view(4, 16).block_tables.shape == (4, 16) and buf.view(4).block_tables.shape == (4, 64)


def test_token_buckets_for_compile() -> None:
    assert [bucket(n) for n in (1, 8, 9, 63, 64, 65)] == [8, 8, 16, 64, 64, 72]
    assert bucket(3, cap=5) == 5 and bucket(70, cap=70) == 70  # never above the step budget


def test_store_kv_sends_padded_slots_to_the_trash_block() -> None:
    blocks, block_size = 3, 4
    k = torch.zeros(pool_blocks(blocks), block_size, 2, 8)
    v = torch.zeros_like(k)
    new_k = torch.arange(4 * 2 * 8, dtype=torch.float32).view(4, 2, 8) + 1
    store_kv(k, v, torch.tensor([3, PAD_SLOT, 9, PAD_SLOT]), new_k, -new_k)
    flat = k.view(-1, 2, 8)
    assert torch.equal(flat[3], new_k[0]) and torch.equal(flat[9], new_k[2])
    real = flat[: blocks * block_size]
    written = {i for i in range(real.shape[0]) if real[i].abs().sum() > 0}
    assert written == {3, 9}  # padded tokens touched no block the block manager hands out
    assert torch.equal(v.view(-1, 2, 8)[9], -new_k[2])


def test_buffers_pad_rows_past_the_batch() -> None:
    buf = DecodeBuffers(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    buf.fill(3, 4, torch.tensor([11, 12, 13]), torch.tensor([0, 5, 9]), torch.tensor([[7, 0, 0], [2, 3, 0], [4, 5, 6]]))
    buf.set_slots(3, block_size=4)
    assert buf.slots[:4].tolist() == [28, 13, 25, PAD_SLOT]
    assert buf.context_lens[:4].tolist() == [1, 6, 10, 1]
    assert buf.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buf.block_tables[3].tolist() == [0, 0, 0, 0]
    assert buf.view(4).block_tables.shape == (4, 4)


@pytest.mark.parametrize("window, softcap", [(None, None), (3, None), (None, 5.0)])
def test_static_decode_attention_matches_per_sequence_reference(window: int | None, softcap: float | None) -> None:
    torch.manual_seed(0)
    heads, kvh, d, block_size, blocks = 4, 2, 8, 4, 10
    k_cache = torch.randn(blocks, block_size, kvh, d)
    v_cache = torch.randn(blocks, block_size, kvh, d)
    buf = DecodeBuffers(max_batch=4, max_blocks=3, device=torch.device("cpu"))
    tables = torch.tensor([[1, 4, 0], [7, 2, 9], [3, 0, 0]])
    positions = torch.tensor([5, 10, 0])  # context lengths 6, 11, 1
    buf.fill(3, 4, torch.zeros(3, dtype=torch.long), positions, tables)
    q = torch.randn(heads, 4, d)
    out = static_decode_attention(q, k_cache, v_cache, buf.view(4), 0.3, window, softcap)
    assert out.shape == (4, heads, d) and torch.isfinite(out[3]).all()  # the padded row stays finite
    for b in range(3):
        n = int(positions[b]) + 1
        keys = k_cache[tables[b]].reshape(-1, kvh, d)[:n].repeat_interleave(heads // kvh, 1)  # [n, H, D]
        vals = v_cache[tables[b]].reshape(-1, kvh, d)[:n].repeat_interleave(heads // kvh, 1)
        scores = torch.einsum("hd,nhd->hn", q[:, b], keys) * 0.3
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if window is not None:
            scores[:, : max(0, n - window)] = float("-inf")
        want = torch.einsum("hn,nhd->hd", scores.softmax(-1), vals)
        torch.testing.assert_close(out[b], want, rtol=1e-5, atol=1e-5)


class _ReplayByRerun(DecodeGraphs):
    """DecodeGraphs without CUDA: "capture" keeps the step's context and call, "replay" runs the
    same call again, which is what replaying a captured graph computes."""

    def capture(self, key: GraphKey, run: Callable[[Callable[[], torch.Tensor]], torch.Tensor]) -> None:
        call = self.step_call(key[0])
        self.graphs[key] = lambda: run(call)  # type: ignore[assignment]

    def replay(self, key: GraphKey, n: int) -> torch.Tensor:
        return self.graphs[key]()[:n]  # type: ignore[operator]


@pytest.mark.parametrize("pool_blocks", [None, 48])
def test_graph_decode_steps_give_the_eager_tokens(tiny_model: Callable[[str], Path], pool_blocks: int | None) -> None:
    """The model runner's CUDA-graph decode path (static buffers, buckets, widths, the static
    attention, one context reused across replays) on CPU, with only the capture itself stood in for.
    With a 48-block pool, steps whose gather (rows x width) would exceed the pool run eagerly."""
    path = str(tiny_model("llama"))
    lengths, max_tokens = [5, 40, 200, 300], [12, 9, 6, 3]  # the batch shrinks; the longest row ends first: 2 widths
    prompts = [[2 + (i * 7 + j) % 250 for j in range(n)] for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    eager = LLM(path, device="cpu", attention_backend="torch", num_kv_blocks=pool_blocks).generate(prompts, params)
    llm = LLM(path, device="cpu", attention_backend="torch", num_kv_blocks=pool_blocks)
    runner = llm.engine.runner
    inputs: list[set[int]] = []

    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        inputs.append({t.untyped_storage().data_ptr() for t in tensors})
        return runner.forward(*tensors)

    max_blocks = -(-llm.config.max_model_len // runner.block_size)
    graphs = GraphDecode(forward, runner.kv_caches, 4, max_blocks, runner.block_size, runner.device)
    graphs.graphs = _ReplayByRerun(forward, graphs.buffers)
    runner.graphs = graphs
    out = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in eager]
    keys = set(graphs.graphs.graphs)
    assert graphs.captures == len(keys)  # one capture per key, counted (the GPU check asserts none while timing)
    static = {t.untyped_storage().data_ptr() for t in (graphs.buffers.input_ids, graphs.buffers.positions)}
    static.add(graphs.buffers.keep.untyped_storage().data_ptr())
    assert inputs and all(seen <= static for seen in inputs)  # a graph may read nothing a step frees
    if pool_blocks is None:
        assert {w for _, w in keys} == {16, 32} and {b for b, _ in keys} >= {1, 2, 4}
    else:
        assert keys and all(b * w <= pool_blocks for b, w in keys) and (4, 16) not in keys
