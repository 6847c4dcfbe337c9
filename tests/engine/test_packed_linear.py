"""The packed bf16 linear (csrc/vnni_linear_bf16.c through batchgen::packed_linear, engine/cpu/packed_linear).

It must be torch's float32 matmul of the same bf16 inputs (within float32 summation order) on any
shape (columns past a whole panel, odd in-features, rows 1..65, strided rows), round that once to
bf16, replace the layer's weight rather than add a copy, let a tied embedding read its rows from the
packing (any other shared weight left alone), and exist only
where the linear library was built for AVX512-BF16. Greedy parity through it: test_bf16_parity.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from batchgen.engine.cpu import host, native, native_linear, packed_linear
from batchgen.engine.cpu.packed_linear import PackedEmbedding, PackedLinear, pack, pack_linears

# (rows, out, in): panels of 64 columns cut short (1, 63, 65, 130), odd in-features (1, 3, 513, 1025:
# a last pair half empty), in-features over two chunks of 256 pairs (600, 1,025, 1,536), rows 1..65 and 400
SHAPES = [
    (1, 1, 1),
    (2, 63, 3),
    (5, 64, 2),
    (6, 65, 513),
    (7, 130, 64),
    (16, 128, 1025),
    (33, 96, 1536),
    (64, 200, 96),
    (65, 64, 1024),
    (400, 70, 600),  # a prefill chunk's rows, in-features past one chunk
]


def _available() -> bool:
    """What the host and the build flags say: AVX512-BF16 on the CPU, not an AVX2-only build, kernels on."""
    return (
        host.cpu_flags().get("avx512_bf16", False)
        and "-mno-avx512f" not in native.extra_flags()
        and os.environ.get(native.DISABLE_ENV) != "0"
    )


needs_kernel = pytest.mark.skipif(not _available(), reason="no AVX512-BF16 on this CPU or build: nothing is packed")


@pytest.fixture(scope="module", autouse=True)
def _operator() -> None:
    assert native_linear.load_op(), "the native linear operator did not build (see the log)"


def test_the_kernel_exists_exactly_where_the_cpu_computes_bf16() -> None:
    assert (native.vnni_linear() is not None) == _available()
    if not _available():  # so an engine never packs: pack_linears hands every layer back
        layer = nn.Linear(64, 64).to(torch.bfloat16)
        assert pack_linears(nn.Sequential(layer), [layer], Path("lib"), F.linear) == [layer]
        assert type(layer) is nn.Linear


def _data(rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    return x.bfloat16(), w.bfloat16(), b.bfloat16()


def _float32_out(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """The kernel's float32 output (y_float), x's rows as strided as they are."""
    fns = native.vnni_linear()
    assert fns is not None
    out = torch.empty(x.shape[0], n)
    b = None if bias is None else ctypes.c_void_p(bias.data_ptr())
    args = (x.data_ptr(), x.stride(0), packed.data_ptr(), b, out.data_ptr(), 1, 2)
    assert fns["linear"](x.shape[0], n, x.shape[1], *args) == 0
    return out


@needs_kernel
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_float32_sums_are_torchs_float32_matmul_of_the_bf16_inputs(rows: int, n: int, k: int) -> None:
    x, w, b = _data(rows, n, k, seed=rows * 7 + n + k)
    want = x.float() @ w.float().T + b.float()  # [rows, n]: every product exact in float32
    wide = torch.zeros(rows, k + 5, dtype=torch.bfloat16)  # rows further apart than k (a slice of a wider tensor)
    wide[:, :k] = x
    for rows_of in (x, wide[:, :k]):
        got = _float32_out(rows_of, pack(w), b, n)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k**0.5)


@needs_kernel
@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
def test_the_operator_rounds_those_sums_once_to_bf16(rows: int, n: int, k: int) -> None:
    x, w, b = _data(rows, n, k, seed=rows + n * 3 + k)
    for bias in (b, None):
        got = packed_linear.packed_linear(x.view(1, rows, k), pack(w), bias, n)  # [1, rows, n]: batch dims kept
        assert got.dtype == torch.bfloat16 and got.shape == (1, rows, n)
        exact = _float32_out(x, pack(w), bias, n)
        torch.testing.assert_close(got[0], exact.bfloat16(), rtol=0, atol=0)  # one rounding, nearest even


class _Tied(nn.Module):
    """An embedding whose weight the head shares, and two linears of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64, bias=False)
        self.head = nn.Linear(64, 100, bias=False)
        self.head.weight = self.embed.weight


def _bytes(model: nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@needs_kernel
def test_the_packed_weight_replaces_the_layers_and_a_tied_embedding_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "choices", lambda groups, *_: dict.fromkeys(groups, True))
    model = _Tied().to(torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    up, down, table = (m.weight.detach().clone() for m in (model.up, model.down, model.embed))
    logits = model.head(x)  # [3, 100], before packing
    before = _bytes(model)
    left = pack_linears(model, [model.up, model.down, model.head], Path("lib"), F.linear)
    assert left == [] and all(isinstance(m, PackedLinear) for m in (model.up, model.down, model.head))
    assert isinstance(model.embed, PackedEmbedding) and model.embed.packed is model.head.packed  # one copy
    assert "weight" not in model.up._parameters and "weight" not in model.embed._parameters
    padding = (128 - 100) * 64 * 2  # the head's 100 columns padded to two whole panels; up and down fill theirs
    assert _bytes(model) == before + padding  # not a second copy of any weight
    with torch.inference_mode():
        ids = torch.tensor([[0, 63, 64], [99, 5, 0]])  # both panels, their edges, the last row
        assert torch.equal(model.embed(ids), table[ids])  # [2, 3, 64]: the rows, bit for bit
        torch.testing.assert_close(model.head(x), logits, rtol=2**-7, atol=1e-2)
        hidden = model.up(x)
        want = x.float() @ up.float().T + model.up.bias.float()  # [3, 128]
        torch.testing.assert_close(hidden.float(), want, rtol=2**-7, atol=1e-2)
        torch.testing.assert_close(model.down(hidden).float(), hidden.float() @ down.float().T, rtol=2**-7, atol=1e-2)


@needs_kernel
def test_an_embedding_of_odd_width_reads_its_rows_from_the_packing() -> None:
    table = torch.randn(130, 65).bfloat16()  # a panel cut short, a last pair half empty
    ids = torch.tensor([129, 0, 64, 127, 65])
    assert torch.equal(packed_linear.packed_rows(pack(table), ids, 65), table[ids])


@needs_kernel
def test_a_weight_shared_with_another_linear_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "choices", lambda groups, *_: dict.fromkeys(groups, True))
    model = _Tied().to(torch.bfloat16)
    model.down.weight = model.up.weight = nn.Parameter(torch.randn(64, 64).bfloat16())
    model.up.bias = None
    left = pack_linears(model, [model.up, model.down], Path("lib"), F.linear)
    assert left == [model.up, model.down] and type(model.up) is nn.Linear and type(model.down) is nn.Linear


@needs_kernel
def test_install_packs_only_where_chosen_and_routes_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "choices", lambda groups, *_: {k: k.startswith("128x") for k in groups})
    monkeypatch.setattr(
        native_linear.linear_calibration, "masks", lambda groups, *_: dict.fromkeys(groups, native_linear.EVERY_BUCKET)
    )
    model = _Tied().to(torch.bfloat16)
    assert native_linear.install_native_linears(model, torch.device("cpu"), torch.bfloat16) == 3
    assert isinstance(model.up, PackedLinear)  # 128x64+bias:bfloat16
    assert type(model.down) is native_linear.NativeLinear and type(model.head) is native_linear.NativeLinear


@needs_kernel
def test_the_choice_records_what_it_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear, "COLD_BYTES", 1 << 16)
    layers = [(torch.randn(128, 64).bfloat16(), None)] * 2
    record = packed_linear.measure(layers, float("inf"), native_linear.kernel_linear)
    assert record is not None and isinstance(record["packed"], bool) and record["load"] >= 0
    assert set(record["us"]) <= set(packed_linear.ROWS) and 1 in record["us"]  # a veto may end it early
    for sides in record["us"].values():
        assert set(sides) == {"packed", "torch", "other"} and all(us > 0 for us in sides.values())
