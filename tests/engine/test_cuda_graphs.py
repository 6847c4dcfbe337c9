"""The CPU-testable parts of CUDA-graph decode: buckets, static-buffer padding, the fixed-shape
decode attention, and the KV store's skipping of padded slots (-1). Capture and replay need CUDA."""

from __future__ import annotations

import pytest
import torch

from batchgen.engine.compiled_forward import bucket
from batchgen.engine.cuda_graphs import DecodeBuffers, decode_buckets, pick_bucket, static_decode_attention
from batchgen.engine.kv_store import PAD_SLOT, pool_blocks, store_kv


def test_decode_buckets_and_choice() -> None:
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(3) == [1, 2, 3]
    buckets = decode_buckets(64)
    assert [pick_bucket(n, buckets) for n in (1, 3, 5, 17, 64)] == [1, 4, 8, 32, 64]
    assert pick_bucket(65, buckets) is None  # runs without a graph


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
