"""The native decode-attention kernel (csrc/decode_attention.c via native.py and decode_native.py).

Against float64 attention over exactly each row's positions, through the same NativeStep the
engine builds (row addresses per class and layer, shared prefixes read from a group's first row,
sliding windows), for specialised and generic (query heads per KV head, head dim) shapes; plus
its build: cached by content, refused cleanly without a compiler or when switched off.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest
import torch

from batchgen.engine.cpu import native
from batchgen.engine.cpu.decode_native import ClassRows, NativeStep, Scratch, fill_row

from .conftest import Avx2Build, failing_compiler

KVH = 2
TILE = native.TILE


def _kernels() -> Path:
    library = native.load()
    assert library is not None, "the native kernel did not build (see the log)"
    return library


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    assert shutil.which("cc") or shutil.which("gcc"), "no C compiler on this machine: CI must have one"
    assert _kernels().is_file()


def _positions(tiled: torch.Tensor) -> torch.Tensor:
    """One row's keys [KVH, cap / TILE, D, TILE] -> [KVH, cap, D] (a copy)."""
    kvh, tiles, d, tile = tiled.shape
    return tiled.permute(0, 1, 3, 2).reshape(kvh, tiles * tile, d).clone()


def _set_positions(tiled: torch.Tensor, start: int, value: float) -> None:
    """One row's keys [KVH, cap / TILE, D, TILE]: positions start.. set to value, in place."""
    kvh, tiles, d, tile = tiled.shape
    positions = _positions(tiled)
    positions[:, start:] = value
    tiled.copy_(positions.view(kvh, tiles, tile, d).permute(0, 1, 3, 2))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [H, D], k/v [KVH, L, D] -> [H, D]: float64 softmax attention over positions start..L-1."""
    g = q.shape[0] // k.shape[0]
    k, v = k[:, start:].double().repeat_interleave(g, 0), v[:, start:].double().repeat_interleave(g, 0)
    scores = torch.einsum("hd,hld->hl", q.double() * q.shape[-1] ** -0.5, k)
    return torch.einsum("hl,hld->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("g, d", [(1, 64), (2, 32), (3, 64), (4, 128), (5, 16), (2, 8)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_attention_over_each_rows_own_positions(
    g: int, d: int, window: int | None, dtype: torch.dtype
) -> None:
    """float32 rows against a float64 reference at float32 tolerance; bf16 rows (the bf16 twin: sums in
    float32, the output rounded once) against the float64 reference over the same bf16 values, at
    bf16's tolerance (an output element's rounding: 2^-9 relative)."""
    gen = torch.Generator().manual_seed(g * 1000 + d)
    layers = 2
    # (rows' lengths after this step, class capacity, shared prefix): full tiles, partial tiles,
    # a row at capacity, one-token rows, a class whose rows share their first 32 positions, and one
    # of 9 rows sharing 48, which the kernel attends in blocks of up to 4 over the prefix (no
    # window), the rows left over one by one
    classes = [
        ([1, 15, 16, 17, 64], 64, 0),
        ([100, 37, 128], 128, 32),
        ([49, 64, 100, 128, 50, 77, 96, 113, 60], 128, 48),
    ]
    parts, full_k, full_v = [], [], []
    for lengths, cap, shared in classes:
        # keys in the kernel's tiles: [rows, KVH, cap / TILE, D, TILE]
        k = [torch.randn(len(lengths), KVH, cap // TILE, d, TILE, generator=gen).to(dtype) for _ in range(layers)]
        v = [torch.randn(len(lengths), KVH, cap, d, generator=gen).to(dtype) for _ in range(layers)]
        for layer in range(layers):  # the shared prefix (whole tiles here): the same K/V in every row
            k[layer][:, :, : shared // TILE] = k[layer][:1, :, : shared // TILE]
            v[layer][:, :, :shared] = v[layer][:1, :, :shared]
            for r, length in enumerate(lengths):  # NaN past each row's length: the kernel must never read there
                _set_positions(k[layer][r], length, float("nan"))
                v[layer][r, :, length:] = float("nan")
        parts.append(ClassRows(k, v, len(lengths), shared))
        # what each row attends to: its own row, but a shared prefix as the class's first row holds it
        full_k += [[_positions(t[r]) for t in k] for r in range(len(lengths))]  # [row][layer] [KVH, cap, D]
        full_v += [[t[r].clone() for t in v] for r in range(len(lengths))]
        for layer in range(layers if shared else 0):  # why: shows the prefix's first tile is read from row 0
            k[layer][1:, :, 0] = torch.randn(len(lengths) - 1, KVH, d, TILE, generator=gen).to(dtype)
            v[layer][1:, :, :TILE] = torch.randn(len(lengths) - 1, KVH, TILE, d, generator=gen).to(dtype)
    lengths = [n for ls, _, _ in classes for n in ls]
    n = len(lengths)
    step = NativeStep(parts, lengths, Scratch())
    for layer in range(layers):
        q = torch.randn(n, KVH * g, d, generator=gen).to(dtype)
        new_k, new_v = torch.randn(2, n, KVH, d, generator=gen).to(dtype)
        out = torch.full((n, KVH * g, d), float("nan"), dtype=dtype)
        # as the attention op hands them over: [heads, tokens, D] views, here of [tokens, heads, D]
        step.attend(layer, q.transpose(0, 1), new_k.transpose(0, 1), new_v.transpose(0, 1), out, d**-0.5, window)
        for i, length in enumerate(lengths):
            full_k[i][layer][:, length - 1] = new_k[i]
            full_v[i][layer][:, length - 1] = new_v[i]
            start = max(0, length - window) if window else 0
            expected = _reference(q[i], full_k[i][layer][:, :length], full_v[i][layer][:, :length], start)
            tol = 2e-5 if dtype == torch.float32 else 8e-3
            torch.testing.assert_close(out[i].double(), expected, atol=tol, rtol=tol)
    # the appended K/V are in the rows, at each row's last position, for the next steps to read
    rows = [(part, r) for part in parts for r in range(part.num_rows)]
    for i, (part, r) in enumerate(rows):
        for layer in range(layers):
            k, v = _positions(part.k[layer][r]), part.v[layer][r]
            if part.shared and r > 0:  # the stand-in values the kernel was never to read stay as they were
                k, v = k[:, TILE:], v[:, TILE:]
                full_k[i][layer], full_v[i][layer] = full_k[i][layer][:, TILE:], full_v[i][layer][:, TILE:]
            torch.testing.assert_close(k, full_k[i][layer], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(v, full_v[i][layer], rtol=0, atol=0, equal_nan=True)
    assert step.calls == layers


def test_decodes_in_rows_with_holes_read_their_own_rows_and_the_prefix_from_the_lowest() -> None:
    """decode_rows leaves a finished sequence's row as a hole: the kernel must read each decode's
    own row, the shared prefix from the lowest of them, and never touch a hole."""
    gen = torch.Generator().manual_seed(5)
    g, d, cap, shared = 2, 32, 64, 32
    rows, lengths = [1, 2, 4, 5, 6], [40, 64, 33, 50, 47]  # 4 attended as a block, 1 alone
    k = [torch.randn(8, KVH, cap // TILE, d, TILE, generator=gen)]
    v = [torch.randn(8, KVH, cap, d, generator=gen)]
    holes = [0, 3, 7]
    k[0][holes], v[0][holes] = float("nan"), float("nan")
    k[0][rows, :, : shared // TILE] = k[0][rows[0], :, : shared // TILE]
    v[0][rows, :, :shared] = v[0][rows[0], :, :shared]
    full_k = [_positions(k[0][r]) for r in rows]  # what each decode attends to: the prefix as the lowest row holds it
    full_v = [v[0][r].clone() for r in rows]
    k[0][rows[1:], :, 0] = float("nan")  # the prefix's first tile: only the lowest row's may be read
    v[0][rows[1:], :, :TILE] = float("nan")
    step = NativeStep([ClassRows(k, v, len(rows), shared, rows)], lengths, Scratch())
    q = torch.randn(len(rows), KVH * g, d, generator=gen)
    new_k, new_v = torch.randn(2, len(rows), KVH, d, generator=gen)
    out = torch.full((len(rows), KVH * g, d), float("nan"))
    step.attend(0, q.transpose(0, 1), new_k.transpose(0, 1), new_v.transpose(0, 1), out, d**-0.5, None)
    for i, (row, length) in enumerate(zip(rows, lengths)):
        full_k[i][:, length - 1], full_v[i][:, length - 1] = new_k[i], new_v[i]
        expected = _reference(q[i], full_k[i][:, :length], full_v[i][:, :length], 0)
        torch.testing.assert_close(out[i].double(), expected, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(_positions(k[0][row])[:, length - 1], new_k[i], rtol=0, atol=0)
    assert k[0][holes].isnan().all() and v[0][holes].isnan().all()  # no hole was written


def test_scores_far_below_the_maximum_and_nan_queries() -> None:
    """The kernel's own exp: scores hundreds below their row's maximum weigh (almost) nothing, as in
    float64, and a NaN query gives a NaN output (the engine's NaN check must still see it)."""
    gen = torch.Generator().manual_seed(7)
    d, length, cap = 32, 40, 48
    k = [torch.randn(2, KVH, cap // TILE, d, TILE, generator=gen)]
    v = [torch.randn(2, KVH, cap, d, generator=gen)]
    full_k = [_positions(k[0][r]) for r in range(2)]
    step = NativeStep([ClassRows(k, v, 2, 0)], [length, length], Scratch())
    q = torch.randn(2, KVH * 2, d, generator=gen) * 60  # scores spread over thousands
    q[1, 0, 0] = float("nan")
    new_k, new_v = torch.randn(2, 2, KVH, d, generator=gen)
    out = torch.zeros(2, KVH * 2, d)
    step.attend(0, q.transpose(0, 1), new_k.transpose(0, 1), new_v.transpose(0, 1), out, d**-0.5, None)
    full_k[0][:, length - 1] = new_k[0]
    reference_v = v[0][0, :, :length].clone()
    reference_v[:, length - 1] = new_v[0]
    expected = _reference(q[0], full_k[0][:, :length], reference_v, 0)
    torch.testing.assert_close(out[0].double(), expected, atol=2e-5, rtol=2e-5)
    assert out[1, 0].isnan().all() and not out[1, 2:].isnan().any()  # heads 2-3 read the other KV head


def test_the_kernels_exp_is_within_an_ulp_of_e_to_the_x() -> None:
    """Every 97th float32 in [-87, 0] against float64 exp, rounded; 0 below -87 and for -inf, NaN kept."""
    x = torch.arange(0, 2**31, 97, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x[(x <= 0) & (x >= -87)]  # the non-positive floats in range (sign bit set: int32 < 0)
    x = torch.cat([-x.abs(), torch.tensor([0.0, -1e-30, -87.0])])
    y = torch.empty_like(x)
    native.attention("batchgen_exp_nonpositive", torch.float32)(x.numel(), x.data_ptr(), y.data_ptr())
    exact = x.double().exp()
    ulp = (exact.float().nextafter(torch.tensor(float("inf"))) - exact.float()).double()
    assert ((y.double() - exact).abs() / ulp).max() <= 1.0
    edge = torch.tensor([-87.5, -100.0, -1e30, float("-inf"), float("nan")])
    out = torch.empty_like(edge)
    native.attention("batchgen_exp_nonpositive", torch.float32)(edge.numel(), edge.data_ptr(), out.data_ptr())
    assert out[:4].eq(0).all() and out[4].isnan()


def test_a_row_whose_scores_are_all_minus_infinity_gives_nan() -> None:
    """As torch's softmax does (0 / 0): a diverged query must reach the engine's NaN check."""
    d = 16
    k = [torch.full((1, 1, 1, d, TILE), -1e30)]
    v = [torch.randn(1, 1, TILE, d)]
    step = NativeStep([ClassRows(k, v, 1, 0)], [5], Scratch())
    q = torch.full((1, 1, d), 1e30)  # every score -inf
    new = torch.full((1, 1, d), -1e30)
    out = torch.zeros(1, 1, d)
    step.attend(0, q, new, torch.randn(1, 1, d), out, 1.0, None)
    assert out.isnan().all()


def test_the_limits_are_the_sources() -> None:
    source = (native.CSRC / "decode_attention.c").read_text()
    defined = {name: int(value) for name, value in re.findall(r"#define (\w+) (\d+)", source)}
    assert (defined["TILE"], defined["MAX_G"], defined["MAX_D"], defined["MAX_BLOCK"]) == (
        native.TILE,
        native.MAX_G,
        native.MAX_D,
        native.MAX_BLOCK,
    )


def test_a_decode_whose_class_or_row_is_outside_its_tensors_is_refused_by_the_kernel_itself() -> None:
    """The C side checks the indices it writes through (decode_in_bounds), not only the Python side:
    a step's table rewritten after its checks (a class or row past the tensors) writes nothing."""
    k, v = [torch.zeros(2, 1, 64 // TILE, 8, TILE)], [torch.zeros(2, 1, 64, 8)]
    args = (torch.zeros(1, 2, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.zeros(2, 1, 8), 1.0, None)
    for field, value in (("row", 2), ("row", -1), ("cls", 1)):
        step = NativeStep([ClassRows(k, v, 2, 0)], [3, 4], Scratch())
        at = {"cls": 0, "row": 2}[field]  # the table's sections: cls, row, cap, len, shared (n entries each)
        step._table[at + 1] = value
        with pytest.raises(RuntimeError, match="refused"):
            step.attend(0, *args)
        assert not k[0].any() and not v[0].any()
    step = NativeStep([ClassRows(k, v, 2, 0)], [3, 4], Scratch())
    step.attend(0, *args)  # the same step untouched: attended
    assert v[0][1, 0, 3].eq(1).all()


def _one_row_step(kvh: int = 1, d: int = 8) -> NativeStep:
    k, v = [torch.zeros(2, kvh, 64 // TILE, d, TILE)], [torch.zeros(2, kvh, 64, d)]
    return NativeStep([ClassRows(k, v, 2, 0)], [3, 4], Scratch())


def test_inputs_the_kernel_could_not_address_are_refused() -> None:
    """Each of these passed the earlier checks and made the kernel write past a tensor (or crash)."""
    qkv = (torch.zeros(1, 2, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.zeros(2, 1, 8), 1.0, None)
    pool = (torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8))
    with pytest.raises(RuntimeError, match="slots"):
        _one_row_step().attend(0, *qkv, pool, torch.zeros(2, 0, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="a pool of"):
        _one_row_step().attend(0, *qkv, (pool[0], torch.zeros(1, 4, 1, 8)), torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="a pool of"):
        _one_row_step().attend(0, *qkv, (pool[0].half(), pool[1].half()), torch.tensor([1, 2]))
    with pytest.raises(RuntimeError, match="over rows of 1 KV heads x 4"):
        _one_row_step(d=4).attend(0, *qkv)
    with pytest.raises(RuntimeError, match="runs on the CPU"):
        meta = tuple(t.to("meta") for t in qkv[:4])
        _one_row_step().attend(0, *meta, 1.0, None)
    k, v = [torch.zeros(2, 1, 4, 8, TILE), torch.zeros(2, 1, 2, 8, TILE)], [torch.zeros(2, 1, 64, 8)] * 2
    with pytest.raises(RuntimeError, match="a class of 2 rows"):
        NativeStep([ClassRows(k, v, 2, 0)], [3, 4], Scratch())  # layer 1 is shorter
    with pytest.raises(RuntimeError, match="a class of 3 rows"):
        NativeStep([ClassRows(k[:1], v[:1], 3, 0)], [3, 4, 5], Scratch())  # 3 rows of 2


def test_a_shape_beyond_the_kernels_limits_is_refused_with_its_sizes() -> None:
    k, v = [torch.zeros(1, 1, 4, 300, TILE)], [torch.zeros(1, 1, 64, 300)]
    step = NativeStep([ClassRows(k, v, 1, 0)], [3], Scratch())
    q = torch.zeros(1, 1, 300)
    with pytest.raises(RuntimeError, match="head dim 300"):
        step.attend(0, q, torch.zeros(1, 1, 300), torch.zeros(1, 1, 300), torch.zeros(1, 1, 300), 1.0, None)


def test_a_decode_past_its_row_or_the_pool_is_refused_before_anything_is_written() -> None:
    k, v = [torch.zeros(2, 1, 64 // TILE, 8, TILE)], [torch.zeros(2, 1, 64, 8)]
    args = (torch.zeros(1, 2, 8), torch.ones(1, 2, 8), torch.ones(1, 2, 8), torch.zeros(2, 1, 8), 1.0, None)
    too_long = NativeStep([ClassRows(k, v, 2, 0)], [3, 65], Scratch())
    with pytest.raises(RuntimeError, match="longer than its row"):
        too_long.attend(0, *args)
    pool = (torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8))  # 16 slots
    fits = NativeStep([ClassRows(k, v, 2, 0)], [3, 64], Scratch())
    with pytest.raises(RuntimeError, match="outside the pool"):
        fits.attend(0, *args, pool, torch.tensor([5, 16]))
    assert not k[0].any() and not v[0].any() and not pool[0].any()  # nothing was written
    fits.attend(0, *args, pool, torch.tensor([5, 15]))
    assert pool[0].flatten(0, 1)[[5, 15]].eq(1).all() and _positions(k[0][1])[0, 63].eq(1).all()


@pytest.mark.parametrize("d", [32, 64, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_fill_is_the_pools_positions_in_order(d: int, dtype: torch.dtype) -> None:
    """fill_row copies positions 0..length-1 out of the pool's blocks (in the block table's order,
    not the pool's) into the row's tiles and values, zeroes the rest of the last tile, and writes
    nothing else; for lengths within, at and across tile and block boundaries."""
    gen = torch.Generator().manual_seed(d)
    pool_blocks, block_size, cap = 12, 8, 64
    pool = (
        torch.randn(pool_blocks, block_size, KVH, d, generator=gen).to(dtype),
        torch.randn(pool_blocks, block_size, KVH, d, generator=gen).to(dtype),
    )
    blocks = torch.randperm(pool_blocks, generator=gen)[: cap // block_size]
    for length in (1, 7, 8, 15, 16, 17, 40, 64):
        k_row = torch.full((KVH, cap // TILE, d, TILE), 7.0, dtype=dtype)
        v_row = torch.full((KVH, cap, d), 7.0, dtype=dtype)
        fill_row(pool, blocks, length, k_row, v_row)
        want_k = pool[0][blocks].flatten(0, 1)[:length].transpose(0, 1)  # [KVH, length, D]
        want_v = pool[1][blocks].flatten(0, 1)[:length].transpose(0, 1)
        got_k = _positions(k_row)
        tail = -(-length // TILE) * TILE
        assert torch.equal(got_k[:, :length], want_k) and torch.equal(v_row[:, :length], want_v), length
        assert (got_k[:, length:tail] == 0).all() and (got_k[:, tail:] == 7).all() and (v_row[:, length:] == 7).all()


def test_a_fill_the_row_or_pool_could_not_hold_is_refused() -> None:
    pool = (torch.zeros(4, 8, KVH, 16), torch.zeros(4, 8, KVH, 16))
    k_row, v_row = torch.zeros(KVH, 32 // TILE, 16, TILE), torch.zeros(KVH, 32, 16)
    blocks = torch.tensor([0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="refused 33 positions"):
        fill_row(pool, blocks, 33, k_row, v_row)  # longer than the row
    with pytest.raises(RuntimeError, match="refused 17 positions"):
        fill_row(pool, blocks[:2], 17, k_row, v_row)  # longer than its blocks
    with pytest.raises(RuntimeError, match="refused 9 positions"):
        fill_row(pool, torch.tensor([0, 4]), 9, k_row, v_row)  # a block past the pool
    with pytest.raises(RuntimeError, match="native row fill: pool"):
        fill_row(pool, blocks.int(), 8, k_row, v_row)  # int32 blocks
    with pytest.raises(RuntimeError, match="native row fill: pool"):
        fill_row(pool, blocks, 8, k_row, torch.zeros(KVH, 32, 8))  # another head dim
    with pytest.raises(RuntimeError, match="native row fill: pool"):
        fill_row((pool[0], pool[1].double()), blocks, 8, k_row, v_row)
    assert (k_row == 0).all() and (v_row == 0).all()  # nothing written by any refused call


def test_build_is_cached_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    lib = native.LIBRARIES["argmax"]
    assert native._load(lib) is not None and native.STATES["argmax"].state == "built"
    first = native.STATES["argmax"].path
    assert first is not None and first.parent == tmp_path / "kernels"
    monkeypatch.delitem(native.STATES, "argmax")  # as another process finds it, without loading
    assert native.state("argmax").state == "cached"
    built = first.stat().st_mtime_ns
    assert native._load(lib) is not None and native.STATES["argmax"].state == "cached"
    assert native.STATES["argmax"].path == first and first.stat().st_mtime_ns == built
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [first.name]  # no temporary left
    monkeypatch.delitem(native.STATES, "linear", raising=False)
    assert native.state("linear").state == "not built"  # each library is cached on its own


def test_no_compiler_or_switched_off_means_torch_ops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=native.__name__)
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    fake = failing_compiler(tmp_path, "cc")
    monkeypatch.setenv("CC", str(fake))
    assert native._load(native.LIBRARIES["attention"]) is None
    assert f"{fake} could not build decode_attention.c, decode_attention_bf16.c: fake: no luck" in caplog.text
    assert "decode attention runs on torch ops" in caplog.text
    assert native.STATES["attention"].state == "unavailable"
    assert not list((tmp_path / "kernels").iterdir())  # no half-built file left behind
    monkeypatch.delenv("CC")
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native._load(native.LIBRARIES["attention"]) is None
    assert f"{native.DISABLE_ENV}=0" in caplog.text and native.STATES["attention"].state == "off"


@pytest.mark.slow
def test_a_compiler_that_cannot_build_one_kernel_loses_only_that_one(avx2_build: Avx2Build) -> None:
    """A compiler wrapper that fails on the linear sources only (as GCC 11 did on a GCC 12 builtin):
    the attention and argmax libraries still build and load. Its builds are the AVX2 build's first
    (see avx2_build: one compile of the attention library for both), into a cache it found empty."""
    linear, argmax, attention = (avx2_build.picky[name] for name in ("linear", "argmax", "attention"))
    assert linear[:2] == [False, "unavailable"] and "error: no luck" in str(linear[2])
    assert argmax[:2] == [True, "built"]
    assert attention[:2] == [True, "built"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc-11") is None, reason="gcc-11 is not installed (.ci/run installs it)")
def test_gcc_11_builds_every_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GCC 11 (Ubuntu 22.04, RHEL 9) has no __builtin_shufflevector: the sources must not need it."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "gcc-11")
    for lib in native.LIBRARIES.values():
        assert native._load(lib) is not None, native.STATES[lib.name].reason


def test_a_library_out_of_step_with_the_argument_list_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel reads its arguments from one array by index: a library whose argument names
    (exported from decode_args.h) differ from native.DECODE_ARGS must not load."""
    _kernels()
    monkeypatch.setattr(native, "STATES", dict(native.STATES))  # why: the refusal is recorded there
    monkeypatch.setattr(native, "DECODE_ARGS", native.DECODE_ARGS[:-1])
    assert native.load.__wrapped__() is None
    assert "this module names" in caplog.text and native.STATES["attention"].state == "unavailable"
