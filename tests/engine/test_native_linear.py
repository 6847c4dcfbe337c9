"""The native linear: csrc/skinny_linear.c through the batchgen::linear operator.

It must give F.linear's values at decode sizes, be torch's own F.linear everywhere else, and be
used only for the layers install_native_linears picks. Greedy parity with the layers routed
through it is in test_parity.py.
"""

from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine import native, native_linear, native_ops
from batchgen.engine.native_linear import DECODE_SIZES, EVERY_SIZE, NativeLinear, Reach, install_native_linears

from .conftest import failing_compiler

CPU, F32 = torch.device("cpu"), torch.float32
MAX_ROWS = DECODE_SIZES.max_rows
ANY = 1 << 62  # an operator's max_rows that no call reaches


@pytest.fixture(scope="module", autouse=True)
def _operator() -> None:
    assert native_linear.load_op(), "the native linear operator did not build (see the log)"


def _kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The C kernel called directly, on a 2-D x whose rows may be strided."""
    kernels = native.load()
    assert kernels is not None
    out = torch.empty(x.shape[0], w.shape[0])
    bias = ctypes.c_void_p(b.data_ptr()) if b is not None else None
    ptrs = (x.data_ptr(), x.stride(0), w.data_ptr(), bias, out.data_ptr())
    assert kernels.linear(x.shape[0], w.shape[0], w.shape[1], *ptrs, 2) == 0
    return out


def _data(rows: int, n: int, k: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g) if bias else None
    return torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g), b  # type: ignore[return-value]


# rows: skinny_linear.c's 8-wide tiles (1-3), its 4-wide ones (4-6), several row blocks and a remainder
# (7, 13); wide_linear.c's (24 and up) with 2, 3 and 4 vectors of rows, some padded (24, 33, 64), and
# passes of 64 rows and a remainder (65, 130); n: whole tiles, a tail of rows; k: whole vectors, a tail
# shorter than one, several and a tail
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 24, 33, MAX_ROWS, 65, 130])
@pytest.mark.parametrize(("n", "k"), [(8, 16), (37, 77), (64, 256), (301, 33), (5, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_is_f_linear_in_float64_within_rounding(rows: int, n: int, k: int, bias: bool) -> None:
    x, w, b = _data(rows, n, k, bias, seed=rows * 1000 + n + k)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(_kernel(x, w, b).double(), want, rtol=1e-5, atol=1e-4)


def test_the_operator_takes_the_kernel_up_to_max_rows_and_torch_above() -> None:
    x, w, b = _data(MAX_ROWS + 1, 64, 768, True)
    small = x[:MAX_ROWS]
    via_kernel = torch.ops.batchgen.linear(small, w, b, MAX_ROWS)
    assert torch.equal(via_kernel, _kernel(small, w, b))
    assert not torch.equal(via_kernel, F.linear(small, w, b))  # why: the kernel really ran (its rounding)
    assert torch.equal(torch.ops.batchgen.linear(x, w, b, MAX_ROWS), F.linear(x, w, b))
    big = torch.ops.batchgen.linear(x, w, b, ANY)  # a layer whose reach is every size: prefill too
    assert torch.equal(big, _kernel(x, w, b)) and not torch.equal(big, F.linear(x, w, b))


def test_strided_and_batched_inputs_keep_their_shape() -> None:
    x, w, _ = _data(6, 40, 96, False)
    wide = torch.zeros(2, 3, 192)
    wide[..., ::2] = x.view(2, 3, 96)
    strided = wide[..., ::2]  # [2, 3, 96], last dimension not contiguous
    got = torch.ops.batchgen.linear(strided, w, None, MAX_ROWS)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), _kernel(x, w, None))
    rows_apart = wide.view(6, 192)[:, :96]  # rows 192 floats apart, each contiguous
    assert torch.equal(torch.ops.batchgen.linear(rows_apart, w, None, MAX_ROWS), _kernel(rows_apart, w, None))


def test_what_the_kernel_cannot_read_is_torchs_own_linear() -> None:
    x, w, b = _data(4, 32, 48, True)
    cases = [
        (x.double(), w.double(), b.double()),  # float64
        (x, w.t().contiguous().t(), b),  # a transposed weight
        (x, w, torch.randn(64)[::2]),  # a strided bias
        (x[:0], w, b),  # no rows
    ]
    for args in cases:
        assert torch.equal(torch.ops.batchgen.linear(*args, ANY), F.linear(*args))


def test_a_compiled_graph_calls_the_operator() -> None:
    layer = nn.Linear(96, 40, bias=False)
    layer.__class__ = NativeLinear
    layer.max_rows = MAX_ROWS
    x = torch.randn(1, 5, 96)
    with torch.inference_mode():
        compiled = torch.compile(layer, dynamic=True, fullgraph=True)
        got = compiled(x)
    assert torch.equal(got, torch.ops.batchgen.linear(x, layer.weight, None, MAX_ROWS))
    assert not torch.equal(got, F.linear(x, layer.weight))


class _Adapter(nn.Linear):
    """A subclass with a forward of its own (as LoRA or quantized layers have)."""


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 64),
        _Adapter(64, 64),
        nn.Linear(64, 64).double(),
        nn.Linear(64, 32, bias=False),
    )


def test_plain_float32_linears_of_a_large_enough_model_are_routed() -> None:
    model = _model()
    short = Reach(MAX_ROWS, 64 * 64 + 64 * 32 + 1, "test")
    assert install_native_linears(model, CPU, F32, short) == 0  # its two eligible weights are one element short
    assert all(type(m) is not NativeLinear for m in model)
    assert install_native_linears(model, CPU, F32, Reach(MAX_ROWS, 64 * 64 + 64 * 32, "test")) == 2
    assert [type(m) for m in model] == [NativeLinear, _Adapter, nn.Linear, NativeLinear]
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(model[0](x), _kernel(x, model[0].weight, model[0].bias))
        assert torch.equal(model[3](x), _kernel(x, model[3].weight, None))
        prefill = torch.randn(MAX_ROWS + 1, 64)
        assert torch.equal(model[0](prefill), F.linear(prefill, model[0].weight, model[0].bias))
    assert install_native_linears(model, CPU, F32) == 0  # already routed: nothing more to do


def test_at_every_size_the_demo_model_and_prefill_rows_take_the_kernels_too() -> None:
    from transformers import AutoModelForCausalLM

    demo = AutoModelForCausalLM.from_pretrained(Path(__file__).parents[2] / "sample_data" / "demo-model")
    assert install_native_linears(demo, CPU, F32, DECODE_SIZES) == 0  # 16 MiB of weights: they stay in cache
    assert install_native_linears(demo, CPU, F32, EVERY_SIZE) == 29  # 4 layers x 7, and the LM head
    head = demo.lm_head
    x = torch.randn(300, head.in_features)  # a prefill chunk
    with torch.inference_mode():
        assert torch.equal(head(x), _kernel(x, head.weight, None))


def test_other_devices_and_dtypes_keep_their_linears() -> None:
    model = _model()
    assert install_native_linears(model, CPU, torch.bfloat16, EVERY_SIZE) == 0
    assert install_native_linears(model, torch.device("meta"), F32, EVERY_SIZE) == 0
    assert all(type(m) is not NativeLinear for m in model)


@pytest.mark.parametrize(
    ("vendor", "mkl", "reach"),
    [
        ("GenuineIntel", True, DECODE_SIZES),  # MKL on its own maker's CPU: sgemm is the better at prefill sizes
        ("AuthenticAMD", True, EVERY_SIZE),  # MKL elsewhere: the kernels beat it at every size measured
        ("AuthenticAMD", False, DECODE_SIZES),  # another BLAS: unmeasured, so only where the kernels are built for
        (None, False, DECODE_SIZES),  # not x86 (an ARM server)
    ],
)
def test_how_far_the_kernels_reach_follows_the_blas_and_the_cpu(
    vendor: str | None, mkl: bool, reach: Reach, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    assert native_linear.machine_reach() is reach


def test_this_machines_cpu_vendor_is_read() -> None:
    x86_linux = platform.machine() in ("x86_64", "AMD64") and Path("/proc/cpuinfo").is_file()
    vendor = native.cpu_vendor()
    assert (vendor is not None and vendor.isalnum()) if x86_linux else vendor is None


def test_without_kernels_or_a_cpp_compiler_the_linears_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=native_ops.__name__)
    monkeypatch.setattr(native, "_LOADED", [None])  # as when BATCHGEN_NATIVE=0 or no C compiler
    assert native_linear._load_op() is False
    monkeypatch.undo()
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    fake = failing_compiler(tmp_path, "c++")
    monkeypatch.setenv("CXX", str(fake))
    assert native_linear._load_op() is False
    assert "batchgen_linear_op unavailable" in caplog.text and "fake: no luck" in caplog.text
    monkeypatch.setattr(native_linear, "_OP", [False])
    model = _model()
    assert install_native_linears(model, CPU, F32, EVERY_SIZE) == 0
    assert all(type(m) is not NativeLinear for m in model)
