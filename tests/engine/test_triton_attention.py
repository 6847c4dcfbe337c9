"""The Triton backend's kernels against a float64 softmax reference and the torch backend: random
block tables, ragged chunks with cached context, decodes and prefill chunks in one launch,
sliding windows, soft-capping, GQA ratios 1 to 8, float32 / bfloat16 / float16, padded tokens
(slot -1), and the fixed-buffer plan of CUDA-graph decode steps.

On a machine without CUDA they run under Triton's interpreter: TRITON_INTERPRET=1 is set by
tests/conftest.py before anything imports triton (see there, and triton/support, for why it cannot
be set later), and each test checks it took effect. With CUDA (and the variable unset) the same
tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")  # a machine without triton (not Linux) skips the kernels' tests

from batchgen.engine.attention.backend import TorchBackend
from batchgen.engine.attention.metadata import ForwardContext, StaticDecode
from batchgen.engine.attention.op import LayerCall
from batchgen.engine.core.scheduler_output import ScheduledChunk
from batchgen.engine.triton import support
from batchgen.engine.triton.backend import TritonBackend
from batchgen.engine.triton.plan import tile_map, tile_rows

from .attention_harness import DirectStager, static_decode_attention

if not support.interpreting() and not torch.cuda.is_available():
    pytest.skip("neither Triton's interpreter nor CUDA", allow_module_level=True)

BLOCK, KVH, D = 16, 2, 16
POOL = 14  # blocks the block manager would hand out; the pool has one more (trash)
DEVICE = torch.device("cpu" if support.interpreting() else "cuda")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}
Spec = tuple[int, int]  # (tokens cached before the chunk, new tokens); one new token after a context: a decode
Images = dict[int, tuple[tuple[int, int], ...]]  # chunk -> positions [first, end) of its images (Gemma 3's)


@pytest.fixture(autouse=True)
def interpreter() -> None:
    if DEVICE.type == "cpu":
        assert support.interpreter_ready(), "triton was imported before TRITON_INTERPRET=1 (tests/conftest.py)"


class Step:
    """A random step: a pool holding each chunk's cached context, random block tables, the new K/V."""

    def __init__(self, specs: list[Spec], group: int, dtype: torch.dtype, pad: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.specs, self.heads, self.dtype = specs, KVH * group, dtype
        shape = (POOL + 1, BLOCK, KVH, D)
        self.pools = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))]
        ids = torch.randperm(POOL, generator=gen).tolist()  # why random: a table is any blocks, in any order
        self.keys: list[torch.Tensor] = []  # per chunk [KVH, context + new, D]
        self.values: list[torch.Tensor] = []
        self.chunks: list[ScheduledChunk] = []
        for i, (cached, new) in enumerate(specs):
            total = cached + new
            table = [ids.pop() for _ in range(math.ceil(total / BLOCK))]
            k, v = (torch.randn(KVH, total, D, generator=gen).to(dtype) for _ in range(2))
            for p in range(cached):  # the cached context is in the pool already
                self.pools[0][0][table[p // BLOCK], p % BLOCK] = k[:, p]
                self.pools[0][1][table[p // BLOCK], p % BLOCK] = v[:, p]
            self.keys.append(k)
            self.values.append(v)
            decode = new == 1 and cached > 0
            tokens = (2,) * new
            self.chunks.append(ScheduledChunk(i, cached, tokens, tuple(table), needs_sample=True, is_decode=decode))
        junk = torch.randn(KVH, pad, D, generator=gen).to(dtype)  # padded tokens' K/V: never stored
        self.key = torch.cat([k[:, c:] for k, (c, _) in zip(self.keys, specs)] + [junk], 1)  # [KVH, T + pad, D]
        self.value = torch.cat([v[:, c:] for v, (c, _) in zip(self.values, specs)] + [junk], 1)
        tokens = self.key.shape[1]
        # [H, T + pad, D] as the model hands it: a transposed view of [T, H, D]
        self.query = torch.randn(tokens, self.heads, D, generator=gen).to(dtype).transpose(0, 1)
        self.num_tokens = tokens - pad

    def run(
        self, backend_cls: type, window: int | None, softcap: float | None, images: Images | None = None
    ) -> torch.Tensor:
        """`images`: chunk index -> positions [first, end) of images whose tokens attend both ways,
        marked on the planned step as engine/vision marks them."""
        pools = [(k.to(DEVICE, copy=True), v.to(DEVICE, copy=True)) for k, v in self.pools]
        triton = backend_cls is TritonBackend
        backend = TritonBackend(pools, BLOCK, DEVICE, self.heads) if triton else TorchBackend(pools, BLOCK, DEVICE)
        ctx, _, order = backend.plan(self.chunks, DirectStager(DEVICE), padded_len=self.key.shape[1])
        assert order == list(range(len(self.chunks))) or not triton  # the torch backend packs decodes first
        starts = [0]
        for _, new in self.specs:
            starts.append(starts[-1] + new)
        by_start = {p.start: p for p in ctx.prefills}
        packed_start = 0
        for i in order:
            if i in (images or {}):
                by_start[packed_start].bidirectional = images[i]  # type: ignore[index]
            packed_start += self.specs[i][1]
        packed = [t for i in order for t in range(starts[i], starts[i + 1])]
        packed += list(range(starts[-1], self.key.shape[1]))  # the padding, last
        q, k, v = self.query, self.key, self.value  # why not indexed when in order: the strided views
        if packed != sorted(packed):
            q, k, v = q[:, packed], k[:, packed], v[:, packed]
        with backend.running(ctx):
            out = backend.run_layer(LayerCall(0, D**-0.5, window, softcap), *(x.to(DEVICE) for x in (q, k, v)))
        self.stored = (pools[0][0].cpu(), pools[0][1].cpu())
        return out.cpu()[torch.tensor(packed).argsort()]  # [T + pad, H, D] in batch order

    def reference(self, window: int | None, softcap: float | None, images: Images | None = None) -> torch.Tensor:
        """Float64 softmax attention of each chunk's queries over its whole context -> [T, H, D];
        a query inside one of `images` also sees that image's later keys (within the window)."""
        out, first = [], 0
        for i, ((cached, new), k, v) in enumerate(zip(self.specs, self.keys, self.values)):
            q = self.query[:, first : first + new].double()  # [H, n, D]
            k, v = (x.double().repeat_interleave(self.heads // KVH, 0) for x in (k, v))  # [H, L, D]
            scores = q @ k.transpose(1, 2) * D**-0.5
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            q_pos, kv_pos = torch.arange(cached, cached + new)[:, None], torch.arange(cached + new)[None]
            allowed = kv_pos <= q_pos
            for a, b in (images or {}).get(i, ()):
                allowed |= (q_pos >= a) & (q_pos < b) & (kv_pos >= a) & (kv_pos < b)
            if window is not None:
                allowed &= kv_pos > q_pos - window
            out.append((scores.masked_fill(~allowed, -math.inf).softmax(-1) @ v).transpose(0, 1))
            first += new
        return torch.cat(out)


CASES = [  # specs, query heads per KV head, window, soft-cap, dtype
    ([(0, 21), (17, 1), (5, 11), (33, 1)], 1, None, None, torch.float32),
    ([(30, 1), (0, 40), (12, 9), (3, 1)], 2, 7, None, torch.float32),
    ([(19, 1), (3, 14), (0, 1)], 4, None, 2.0, torch.float32),
    ([(25, 1), (0, 30), (16, 16)], 3, 9, 5.0, torch.bfloat16),
    ([(40, 1), (8, 12)], 8, 20, None, torch.float16),
]


@pytest.mark.parametrize(("specs", "group", "window", "softcap", "dtype"), CASES)
def test_one_launch_attends_prefills_and_decodes_as_softmax_does(
    specs: list[Spec], group: int, window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    step = Step(specs, group, dtype, pad=3, seed=len(specs) * 10 + group)
    out = step.run(TritonBackend, window, softcap)  # [T + pad, H, D]
    want = step.reference(window, softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out[: step.num_tokens].double(), want, atol=tol, rtol=tol)
    assert not out[step.num_tokens :].any()  # padded rows: zero
    if window is not None or softcap is not None:  # the case really exercises them: the plain answer differs
        assert not torch.allclose(step.reference(None, None), want, atol=10 * tol)
    if dtype == torch.float32:  # the torch backend, the oracle, on the same step
        ours = step.stored
        torch.testing.assert_close(out, step.run(TorchBackend, window, softcap), atol=tol, rtol=tol)
        # the same pool writes (but for the trash block, where the torch backend sends padded tokens)
        assert all(torch.equal(a[:POOL], b[:POOL]) for a, b in zip(ours, step.stored))


IMAGE_CASES = [  # specs, query heads per KV head, window, images (chunk -> [first, end) positions)
    ([(0, 21), (17, 1), (5, 11)], 2, None, {0: ((3, 9), (12, 20)), 2: ((7, 13),)}),
    # 16 tokens a tile: the 20-token image spans two tiles (the first tile reads keys up to 30)
    ([(0, 40), (12, 9), (30, 1)], 4, None, {0: ((10, 30),), 1: ((12, 18),)}),
    ([(0, 40), (12, 9)], 4, 7, {0: ((10, 30),), 1: ((14, 21),)}),  # the window still bounds what lies behind
]


@pytest.mark.parametrize(("specs", "group", "window", "images"), IMAGE_CASES)
def test_images_attend_both_ways_as_the_torch_prefill_mask_does(
    specs: list[Spec], group: int, window: int | None, images: Images
) -> None:
    """Gemma 3: a query token inside an image also sees the image's later tokens; the kernel
    against the float64 reference and the torch backend's prefill mask, on the same marked step."""
    step = Step(specs, group, torch.float32, pad=3, seed=group + 40)
    out = step.run(TritonBackend, window, None, images)
    want = step.reference(window, None, images)
    torch.testing.assert_close(out[: step.num_tokens].double(), want, atol=2e-5, rtol=2e-5)
    assert not torch.allclose(step.reference(window, None), want, atol=1e-3)  # the mask matters here
    torch.testing.assert_close(out, step.run(TorchBackend, window, None, images), atol=2e-5, rtol=2e-5)


def test_the_store_writes_each_token_at_its_slot_and_skips_padding() -> None:
    step = Step([(5, 11), (17, 1)], 2, torch.float32, pad=4, seed=3)
    step.run(TritonBackend, None, None)
    k_pool, v_pool = step.stored
    expected_k, expected_v = step.pools[0][0].clone(), step.pools[0][1].clone()
    for chunk, k, v in zip(step.chunks, step.keys, step.values):
        for p in range(chunk.start, chunk.start + chunk.num_tokens):
            block = chunk.block_table[p // BLOCK]
            expected_k[block, p % BLOCK], expected_v[block, p % BLOCK] = k[:, p], v[:, p]
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)  # nothing else written
    assert not k_pool[POOL].any()  # the trash block too: padded tokens are skipped


def test_a_graph_decode_step_reads_only_fixed_buffers() -> None:
    """A CUDA-graph decode step (cuda/graphs' StaticDecode: 3 rows and a padded one in a bucket of
    4, tables 3 blocks wide in buffers 5 wide): the same answer as the reference graph attention
    (attention_harness), from plan tensors that are the backend's own buffers at every step."""
    gen = torch.Generator().manual_seed(7)
    shape = (POOL + 1, BLOCK, KVH, D)
    pools = [(torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE))]
    tables = torch.zeros(6, 5, dtype=torch.int64)
    tables[:3, :3] = torch.randperm(POOL, generator=gen)[:9].view(3, 3)
    lens = torch.tensor([40, 7, 33, 1, 1, 1])  # row 3: padding (block 0, one key)
    slots = torch.full((6,), -1, dtype=torch.int64)
    slots[:3] = tables[torch.arange(3), (lens[:3] - 1) // BLOCK] * BLOCK + (lens[:3] - 1) % BLOCK
    tables, lens, slots = tables.to(DEVICE), lens.to(DEVICE), slots.to(DEVICE)  # the runner's static buffers
    static = StaticDecode(tables[:4, :3], lens[:4])
    backend = TritonBackend(pools, BLOCK, DEVICE, 2 * KVH)
    query = torch.randn(2 * KVH, 4, D, generator=gen).to(DEVICE)
    key, value = (torch.randn(KVH, 4, D, generator=gen).to(DEVICE) for _ in range(2))
    ctx = ForwardContext(pools, slots[:4], None, [], num_tokens=4, static_decode=static)
    with backend.running(ctx):
        out = backend.run_layer(LayerCall(0, 0.3, 12, 4.0), query, key, value)
    want = static_decode_attention(query, *pools[0], static, 0.3, 12, 4.0)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    plan, again = backend.graph_rows.plan(static), backend.graph_rows.plan(static)
    for name in ("query_start", "kv_lens", "block_tables", "tile_chunk", "tile_first"):
        assert getattr(plan, name).data_ptr() == getattr(again, name).data_ptr()
    assert plan.query_start.data_ptr() == backend.graph_rows.arange.data_ptr()


def test_tiles_split_chunks_by_the_tokens_a_tile_holds() -> None:
    chunks, firsts = tile_map([3, 1, 5], 2)
    assert chunks.tolist() == [0, 0, 1, 2, 2, 2] and firsts.tolist() == [0, 2, 0, 0, 2, 4]
    assert [tile_rows(g, True) for g in (1, 3, 16, 32)] == [16, 16, 16, 32]
    assert [tile_rows(g, False) for g in (1, 8, 100)] == [64, 64, 128]


def test_the_cpu_backend_is_refused_when_triton_was_imported_without_the_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pools = [(torch.zeros(POOL + 1, BLOCK, KVH, D), torch.zeros(POOL + 1, BLOCK, KVH, D))]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(support, "interpreter_ready", lambda: False)
    with pytest.raises(ValueError, match="set after triton was first imported"):
        TritonBackend(pools, BLOCK, torch.device("cpu"), KVH)
