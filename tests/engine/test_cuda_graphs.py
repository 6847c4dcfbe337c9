"""The CPU-testable parts of CUDA-graph decode: buckets, static-buffer padding, the fixed-shape
decode attention's reference (attention_harness), and the KV store's skipping of padded slots (-1).
Capture and replay need CUDA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.attention.kv_store import PAD_SLOT, pool_blocks, store_kv
from batchgen.engine.cuda.graphs import (
    DecodeBuffers,
    GraphDecode,
    decode_buckets,
    pick_bucket,
)
from batchgen.engine.runner.compiled_forward import bucket

from .attention_harness import static_decode_attention


def test_decode_buckets_and_choice() -> None:
    """Smallest bucket 2: a size-1 dimension would be specialised by dynamo (a second compiled graph)."""
    assert decode_buckets(64) == [2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [2, 4, 8, 16, 32, 40]
    assert decode_buckets(3) == [2, 3] and decode_buckets(1) == [2]
    buckets = decode_buckets(64)
    assert [pick_bucket(n, buckets) for n in (1, 3, 5, 17, 64)] == [2, 4, 8, 32, 64]
    assert pick_bucket(65, buckets) is None  # runs without a graph
    buf = DecodeBuffers(max_batch=8, max_blocks=64, device=torch.device("cpu"))
    assert buf.view(4).block_tables.shape == (4, 64)  # every graph reads the full width


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


class _ReplayByRerun(GraphDecode):
    """GraphDecode without CUDA: "capture" keeps the step's context and call, "replay" runs the
    same call again, which is what replaying a captured graph computes."""

    def capture(self, bucket: int, run: Callable[[Callable[[], torch.Tensor]], torch.Tensor]) -> None:
        call = self.step_call(bucket)
        self.graphs[bucket] = lambda: run(call)  # type: ignore[assignment]

    def replay(self, bucket: int, n: int) -> torch.Tensor:
        return self.graphs[bucket]()[:n]  # type: ignore[operator]


def test_graph_decode_steps_give_the_eager_tokens(tiny_model: Callable[[str], Path]) -> None:
    """The model runner's CUDA-graph decode path (static buffers, buckets, every graph captured
    before the first step, one context reused across replays) on CPU, with only the capture itself
    stood in for: the triton backend (its interpreter here), the only one graphs replay over."""
    path = str(tiny_model("llama"))
    lengths, max_tokens = [5, 40, 70, 100], [8, 6, 4, 3]  # the batch shrinks from 4 rows to 1
    prompts = [[2 + (i * 7 + j) % 250 for j in range(n)] for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    settings = {"device": "cpu", "attention_backend": "triton", "max_num_seqs": 4, "compile": False}
    eager = LLM(path, **settings).generate(prompts, params)  # type: ignore[arg-type]
    llm = LLM(path, **settings)  # type: ignore[arg-type]
    runner = llm.engine.runner
    inputs: list[set[int]] = []

    def forward(*tensors: torch.Tensor) -> torch.Tensor:
        inputs.append({t.untyped_storage().data_ptr() for t in tensors})
        return runner.forward(*tensors)

    max_blocks = -(-llm.config.max_model_len // runner.block_size)
    graphs = _ReplayByRerun(forward, 2, max_blocks, runner.block_size, runner.device)  # 3-4 rows: no graph
    graphs.capture_all(runner._graph_run, runner._graph_context)  # what the runner does when it is made on CUDA
    assert graphs.captures == 1 and sorted(graphs.graphs) == [2]
    runner.graphs = graphs
    replayed, counts, steps = len(inputs), runner.transfers.counts, llm.stats["steps"]
    uploads = counts.uploads
    out = llm.generate(prompts, params)
    assert counts.uploads - uploads == llm.stats["steps"] - steps  # graph steps and those too wide: one each
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in eager]
    assert len(inputs) > replayed  # decode steps did replay
    assert graphs.captures == 1 and graphs.captures_after_start == 0  # nothing captured once steps ran
    static = {t.untyped_storage().data_ptr() for t in (graphs.buffers.input_ids, graphs.buffers.positions)}
    static.add(graphs.buffers.keep.untyped_storage().data_ptr())
    assert inputs and all(seen <= static for seen in inputs)  # a graph may read nothing a step frees


def test_eager_and_graph_steps_run_one_compiled_forward(tiny_model: Callable[[str], Path]) -> None:
    """On CUDA the forward's inputs are views of the staging buffer (eager steps) or of the graphs'
    static buffers: dynamo specialises a view at storage offset 0 or 1, so neither may sit there, or
    the forward compiles again in the middle of a job. Here with the staging copies made on the CPU
    and the graphs stood in for: one compiled graph for every step."""
    from batchgen.engine.staging.transfers import Transfers

    path = str(tiny_model("llama"))
    prompts = [[2 + (i * 5 + j) % 250 for j in range(n)] for i, n in enumerate([6, 19, 33])]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu", compile=False).generate(prompts, params)]
    llm = LLM(path, device="cpu", attention_backend="triton", max_num_seqs=4, compile=True)
    runner = llm.engine.runner
    runner.transfers = Transfers(torch.device("cpu"), copy=True)
    runner.batch.transfers = runner.transfers
    max_blocks = -(-llm.config.max_model_len // runner.block_size)
    graphs = _ReplayByRerun(runner.forward, 4, max_blocks, runner.block_size, runner.device)
    runner.graphs = graphs
    llm.generate([[3, 4, 5, 6, 7, 8, 9, 10, 11]], params)  # eager steps compile the forward first
    graphs.capture_all(runner._graph_run, runner._graph_context)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert runner.forward.stats.graphs == 1, runner.forward.stats.shapes


def test_buffers_stage_mrope_positions_beside_the_kv_positions() -> None:
    """Under M-RoPE the forward's positions are the [3, B] rope buffer (index + the request's delta),
    while slots and context lengths still follow the KV positions; padding rows read 0."""
    buf = DecodeBuffers(max_batch=8, max_blocks=2, device=torch.device("cpu"), rope_axes=3)
    rope = torch.tensor([[9, -2], [9, -2], [9, -2]])  # positions 5 and 3, deltas +4 and -5
    buf.fill(2, 4, torch.tensor([11, 12]), torch.tensor([5, 3]), torch.tensor([[1, 2], [3, 0]]), rope)
    buf.set_slots(2, block_size=4)
    assert buf.model_positions(4).tolist() == [[9, -2, 0, 0]] * 3
    assert buf.positions[:4].tolist() == [5, 3, 0, 0] and buf.context_lens[:4].tolist() == [6, 4, 1, 1]
    assert buf.slots[:2].tolist() == [9, 15]
    buf.fill(1, 2, torch.tensor([13]), torch.tensor([6]), torch.tensor([[1, 2]]), rope[:, 1:])
    assert buf.model_positions(2).tolist() == [[-2, 0]] * 3  # the last step's row 1 is padding now
    with pytest.raises(RuntimeError, match="M-RoPE"):
        buf.fill(1, 2, torch.tensor([13]), torch.tensor([6]), torch.tensor([[1, 2]]))
    plain = DecodeBuffers(max_batch=4, max_blocks=2, device=torch.device("cpu"))
    plain.fill(1, 2, torch.tensor([13]), torch.tensor([6]), torch.tensor([[1, 2]]))
    assert plain.model_positions(2) is not None and plain.model_positions(2).tolist() == [6, 0]
