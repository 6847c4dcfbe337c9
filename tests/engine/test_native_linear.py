"""The native linear: csrc/skinny_linear.c, wide_linear.c through the batchgen::linear operator.

It must give F.linear's values in the row buckets a layer's mask gives it, be torch's own F.linear
everywhere else, and be used only for the layers and row counts where it measured faster
(linear_calibration). Greedy parity with the layers routed through it is in test_parity.py.
"""

from __future__ import annotations

import ctypes
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchgen.engine.cpu import linear_calibration, native, native_linear
from batchgen.engine.cpu.linear_calibration import bucket
from batchgen.engine.cpu.native_linear import EVERY_BUCKET, NativeLinear, install_native_linears

from .conftest import failing_compiler

CPU, F32 = torch.device("cpu"), torch.float32
MAX_ROWS = 64
UP_TO_64 = (1 << (bucket(MAX_ROWS) + 1)) - 1  # a mask: every row count up to 64
ANY = EVERY_BUCKET


@pytest.fixture(scope="module", autouse=True)
def _operator() -> None:
    assert native_linear.load_op(), "the native linear operator did not build (see the log)"


def _kernel(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The C kernel for x's dtype (float32, or the bf16 twin) called directly, on a 2-D x whose rows may be strided."""
    kernel = native.function("batchgen_linear", x.dtype)
    assert kernel is not None
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype)
    bias = ctypes.c_void_p(b.data_ptr()) if b is not None else None
    ptrs = (x.data_ptr(), x.stride(0), w.data_ptr(), bias, out.data_ptr())
    assert kernel(x.shape[0], w.shape[0], w.shape[1], *ptrs, 2) == 0
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


# bf16: the tiles take every row count (no wide kernel); k: a tail shorter than one bf16 pair vector
# (32), one and a tail, several
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 13, 33, 70])
@pytest.mark.parametrize(("n", "k"), [(8, 16), (37, 77), (64, 256), (5, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_bf16_twin_is_f_linear_in_float64_within_bf16_rounding(rows: int, n: int, k: int, bias: bool) -> None:
    """bf16 x, w and bias (exact in float64), float32 sums, one rounding of the output to bf16."""
    x, w, b = (None if t is None else t.bfloat16() for t in _data(rows, n, k, bias, seed=rows * 1000 + n + k))
    assert x is not None and w is not None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = torch.ops.batchgen.linear(x, w, b, ANY)
    assert got.dtype == torch.bfloat16 and torch.equal(got, _kernel(x, w, b))  # the operator ran the twin
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3 * k**0.5)


def test_the_operator_takes_the_kernel_in_its_masks_buckets_and_torch_elsewhere() -> None:
    x, w, b = _data(MAX_ROWS + 1, 64, 768, True)
    small = x[:MAX_ROWS]
    via_kernel = torch.ops.batchgen.linear(small, w, b, UP_TO_64)
    assert torch.equal(via_kernel, _kernel(small, w, b))
    assert not torch.equal(via_kernel, F.linear(small, w, b))  # why: the kernel really ran (its rounding)
    assert torch.equal(torch.ops.batchgen.linear(x, w, b, UP_TO_64), F.linear(x, w, b))
    big = torch.ops.batchgen.linear(x, w, b, ANY)  # a layer whose mask is every size: prefill too
    assert torch.equal(big, _kernel(x, w, b)) and not torch.equal(big, F.linear(x, w, b))
    only_5_to_8 = 1 << bucket(8)  # a mask with a hole: 1-4 and 9-64 rows on torch
    for rows, kernel in ((4, False), (5, True), (8, True), (9, False)):
        got = torch.ops.batchgen.linear(x[:rows], w, b, only_5_to_8)
        assert torch.equal(got, _kernel(x[:rows], w, b) if kernel else F.linear(x[:rows], w, b)), rows


def test_buckets_are_what_the_operator_computes() -> None:
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 64, 65, 2048, 2049)] == [0, 1, 2, 2, 3, 3, 4, 6, 7, 11, 12]
    assert [linear_calibration.bucket_ends(b) for b in (0, 1, 2, 6)] == [(1,), (2,), (3, 4), (33, 64)]


def test_strided_and_batched_inputs_keep_their_shape() -> None:
    x, w, _ = _data(6, 40, 96, False)
    wide = torch.zeros(2, 3, 192)
    wide[..., ::2] = x.view(2, 3, 96)
    strided = wide[..., ::2]  # [2, 3, 96], last dimension not contiguous
    got = torch.ops.batchgen.linear(strided, w, None, UP_TO_64)
    assert got.shape == (2, 3, 40)
    assert torch.equal(got.reshape(6, 40), _kernel(x, w, None))
    rows_apart = wide.view(6, 192)[:, :96]  # rows 192 floats apart, each contiguous
    assert torch.equal(torch.ops.batchgen.linear(rows_apart, w, None, UP_TO_64), _kernel(rows_apart, w, None))


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
    layer.buckets = UP_TO_64
    x = torch.randn(1, 5, 96)
    with torch.inference_mode():
        compiled = torch.compile(layer, dynamic=True, fullgraph=True)
        got = compiled(x)
    assert torch.equal(got, torch.ops.batchgen.linear(x, layer.weight, None, UP_TO_64))
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


def test_only_plain_float32_linears_of_shapes_with_a_bucket_are_routed() -> None:
    model = _model()
    masks = {"64x64+bias": UP_TO_64, "32x64": 0}
    assert install_native_linears(model, CPU, F32, masks) == 1
    assert [type(m) for m in model] == [NativeLinear, _Adapter, nn.Linear, nn.Linear]
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert torch.equal(model[0](x), _kernel(x, model[0].weight, model[0].bias))
        prefill = torch.randn(MAX_ROWS + 1, 64)
        assert torch.equal(model[0](prefill), F.linear(prefill, model[0].weight, model[0].bias))
    assert install_native_linears(model, CPU, F32, {"32x64": ANY}) == 1  # the one left; routed ones stay
    assert type(model[3]) is NativeLinear and model[0].buckets == UP_TO_64


def test_other_devices_and_dtypes_keep_their_linears() -> None:
    model = _model()
    assert install_native_linears(model, CPU, torch.bfloat16, {"64x64+bias": ANY}) == 0  # float32 layers
    assert install_native_linears(model.half(), CPU, torch.float16, {"64x64+bias:float16": ANY}) == 0
    assert install_native_linears(model, torch.device("meta"), F32, {"64x64+bias": ANY}) == 0
    assert all(type(m) is not NativeLinear for m in model)


def test_a_bf16_model_is_routed_by_its_own_dtypes_masks() -> None:
    """bf16 linears are calibrated and cached under keys of their own (a float32 mask never routes them)."""
    model = _model().to(torch.bfloat16)  # the float64 layer too: two plain 64x64+bias linears in bf16
    assert linear_calibration.shape_key(model[0].weight, model[0].bias) == "64x64+bias:bfloat16"
    assert install_native_linears(model, CPU, torch.bfloat16, {"64x64+bias": ANY}) == 0
    assert install_native_linears(model, CPU, torch.bfloat16, {"64x64+bias:bfloat16": UP_TO_64}) == 2
    assert [type(m) for m in model] == [NativeLinear, _Adapter, NativeLinear, nn.Linear]
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        assert type(model[0]) is NativeLinear and model[0](x).dtype == torch.bfloat16
        assert torch.equal(model[0](x), torch.ops.batchgen.linear(x, model[0].weight, model[0].bias, ANY))


def _slow(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A stand-in 'kernel' that is always slower than torch (three of torch's linears)."""
    for _ in range(2):
        F.linear(x, w, b)
    return F.linear(x, w, b)


def _fast(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A stand-in 'kernel' that is always faster than torch: no work at all."""
    return x


def test_calibration_gives_the_kernel_no_bucket_where_it_is_slower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured, not assumed: a kernel slower than torch at every size takes nothing; one faster
    takes every bucket timed (up to the first whose torch pass is slow)."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    layers = [(torch.randn(64, 64), None) for _ in range(2)]
    assert linear_calibration.measure(layers, _slow, float("inf")) == 0
    assert linear_calibration.measure(layers, _fast, float("inf")) == (1 << len(linear_calibration.BUCKETS)) - 1
    monkeypatch.setattr(linear_calibration, "SLOW_CALL", 0.0)  # every torch pass is "slow": stop after bucket 0
    assert linear_calibration.measure(layers, _fast, float("inf")) == 1
    assert linear_calibration.measure(layers, _fast, 0.0) == 0  # out of time before any timing


def test_calibration_is_cached_once_per_machine_and_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first measurement is every process's choice: a later (different) measurement does not
    replace it, so a job's tokens do not depend on which process timed what."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    groups = {"64x64": [(torch.randn(64, 64), None)]}
    library = Path("batchgen_linear-test.so")
    assert linear_calibration.masks(groups, _slow, library) == {"64x64": 0}
    assert linear_calibration.masks(groups, _fast, library) == {"64x64": 0}  # cached: not measured again
    files = list((tmp_path / "kernels" / "linear-calibration").iterdir())
    assert len(files) == 1 and json.loads(files[0].read_text())["mask"] == 0
    assert linear_calibration.masks(groups, _fast, Path("batchgen_linear-other.so"))["64x64"] != 0  # another build
    assert not [p for p in files[0].parent.iterdir() if p.suffix == ".tmp"]


def test_a_model_is_routed_by_its_own_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """install_native_linears without masks calibrates: whatever it chose, a routed layer's mask is
    non-zero, an unrouted one's is zero, and the choice is read back from the cache the next time."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(linear_calibration, "REPEATS", 2)
    model = _model()
    routed = install_native_linears(model, CPU, F32)
    cached = sorted((tmp_path / "kernels" / "linear-calibration").iterdir())
    assert len(cached) == 2  # the two eligible shapes
    masks = {json.loads(p.read_text())["mask"] for p in cached}
    assert routed == sum(1 for mask in masks if mask)
    for module in (model[0], model[3]):
        assert (type(module) is NativeLinear) == bool(getattr(module, "buckets", 0))


def test_without_kernels_or_a_cpp_compiler_the_linears_stay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=native.__name__)
    monkeypatch.setattr(native, "_HANDLES", {"linear": None})  # as when BATCHGEN_NATIVE=0 or no C compiler
    assert native_linear.load_op.__wrapped__() is False
    monkeypatch.undo()
    monkeypatch.setattr(native, "_HANDLES", {k: v for k, v in native._HANDLES.items() if k != "batchgen_linear_op"})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    fake = failing_compiler(tmp_path, "c++")
    monkeypatch.setenv("CXX", str(fake))
    assert native_linear.load_op.__wrapped__() is False
    assert "batchgen_linear_op kernel unavailable" in caplog.text and "fake: no luck" in caplog.text
    monkeypatch.setattr(native_linear, "load_op", lambda: False)
    model = _model()
    assert install_native_linears(model, CPU, F32, {"64x64+bias": ANY}) == 0
    assert all(type(m) is not NativeLinear for m in model)


def test_a_cache_that_cannot_be_written_still_gives_the_measured_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only home (some containers) must not stop a model from loading."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker))  # kernels/linear-calibration cannot be made under it
    groups = {"64x64": [(torch.randn(64, 64), None)]}
    assert linear_calibration.masks(groups, _slow, Path("batchgen_linear-x.so")) == {"64x64": 0}
