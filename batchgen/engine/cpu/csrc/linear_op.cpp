// batchgen: the torch operator batchgen::linear, F.linear through batchgen_linear at decode sizes.
//
// Why C++ and not a Python custom op: a decode step calls every linear layer once (56 on the 57M
// model), and from a compiled graph a call costs 12.9 us through a Python custom op against 2.8 us
// through this one (aten's own linear: 1.2 us): the Python op's share was 0.65 ms a step. The op takes the kernel
// (csrc/skinny_linear.c, wide_linear.c: its address comes from batchgen_linear_op_setup) for the row
// counts whose bucket is set in the layer's `buckets` mask (bit b: rows in (2^(b-1), 2^b], bit 0: one
// row; native_linear.py sets the bits where the kernel measured faster than torch's BLAS for that
// layer's shape and dtype on this machine) for float32 or bfloat16 inputs it can read (the bf16 twin,
// csrc/skinny_linear_bf16.c, for bf16), and at::linear for everything else,
// so one compiled graph serves every step size. See batchgen/engine/native_linear.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace {

// x, w, bias, y as float32 (batchgen_linear) or bfloat16 (batchgen_linear_bf16), the element type's address
using kernel_fn = int64_t (*)(int64_t, int64_t, int64_t, const void *, int64_t, const void *, const void *, void *,
                              int64_t);
kernel_fn kernel = nullptr, kernel_bf16 = nullptr;

// the kernel for x's dtype where it can read all three (one dtype, on the CPU), else nullptr
kernel_fn readable(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias) {
  const at::ScalarType type = x.scalar_type();
  const kernel_fn fn = type == at::kFloat ? kernel : type == at::kBFloat16 ? kernel_bf16 : nullptr;
  auto cpu_same = [type](const at::Tensor &t) { return t.scalar_type() == type && t.device().is_cpu(); };
  if (fn == nullptr || !cpu_same(x) || !cpu_same(weight) || !weight.is_contiguous() || weight.dim() != 2) return nullptr;
  if (x.dim() < 1 || x.size(-1) != weight.size(1)) return nullptr;
  const bool bias_ok = !bias.has_value() || (cpu_same(*bias) && bias->is_contiguous() && bias->numel() == weight.size(0));
  return bias_ok ? fn : nullptr;
}

// rows' bucket: 0 for one row, b for (2^(b-1), 2^b]
int64_t bucket(int64_t rows) { return rows <= 1 ? 0 : 64 - __builtin_clzll(static_cast<uint64_t>(rows - 1)); }

at::Tensor linear(const at::Tensor &x, const at::Tensor &weight, const std::optional<at::Tensor> &bias,
                  int64_t buckets) {
  const int64_t k = weight.dim() == 2 ? weight.size(1) : 0, n = weight.dim() == 2 ? weight.size(0) : 0;
  const int64_t rows = k > 0 ? x.numel() / k : 0;
  const kernel_fn fn = rows < 1 || bucket(rows) > 62 || !((buckets >> bucket(rows)) & 1) ? nullptr
                                                                                          : readable(x, weight, bias);
  if (fn == nullptr) return at::linear(x, weight, bias);
  at::Tensor flat = x.reshape({rows, k});
  if (flat.stride(1) != 1) flat = flat.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const void *b = bias.has_value() ? bias->data_ptr() : nullptr;
  const int64_t failed =
      fn(rows, n, k, flat.data_ptr(), flat.stride(0), weight.data_ptr(), b, out.data_ptr(), at::get_num_threads());
  TORCH_CHECK(failed == 0, "native linear refused ", rows, " rows for a [", n, ", ", k, "] weight");
  return out;
}

// packed_linear: x [..., k] bf16 @ w^T + bias, w packed once by batchgen_vnni_pack (csrc/vnni_linear_bf16.c)
// for out_features = n columns; every row count takes the kernel (the packed weight replaced nn.Linear's)
using packed_fn = int64_t (*)(int64_t, int64_t, int64_t, const void *, int64_t, const void *, const void *, void *,
                              int64_t, int64_t);
packed_fn packed_kernel = nullptr;

at::Tensor packed_linear(const at::Tensor &x, const at::Tensor &packed, const std::optional<at::Tensor> &bias,
                         int64_t out_features) {
  TORCH_CHECK(packed_kernel != nullptr, "batchgen::packed_linear: the packed bf16 kernel is not set up");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 && x.device().is_cpu() &&
                  packed.device().is_cpu() && packed.is_contiguous() && x.dim() >= 1,
              "batchgen::packed_linear takes bf16 CPU tensors");
  const int64_t k = x.size(-1), n = out_features;
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n),
              "batchgen::packed_linear: the bias must be bf16, contiguous, of ", n, " elements");
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t rows = k > 0 ? x.numel() / k : 0;
  if (rows == 0 || n == 0) return out;
  at::Tensor flat = x.reshape({rows, k});
  if (flat.stride(1) != 1) flat = flat.contiguous();
  const void *b = bias.has_value() ? bias->data_ptr() : nullptr;
  const int64_t failed = packed_kernel(rows, n, k, flat.data_ptr(), flat.stride(0), packed.data_ptr(), b,
                                       out.data_ptr(), 0, at::get_num_threads());
  TORCH_CHECK(failed == 0, "packed linear refused ", rows, " rows for ", n, " x ", k);
  return out;
}

}  // namespace

// fn: batchgen_vnni_linear's address
extern "C" void batchgen_packed_linear_op_setup(void *fn) { packed_kernel = reinterpret_cast<packed_fn>(fn); }

// fn, fn_bf16: batchgen_linear's and batchgen_linear_bf16's addresses
extern "C" void batchgen_linear_op_setup(void *fn, void *fn_bf16) {
  kernel = reinterpret_cast<kernel_fn>(fn);
  kernel_bf16 = reinterpret_cast<kernel_fn>(fn_bf16);
}

// the schema and the fake (shape-only) implementation are defined in native_linear.py
TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("linear", &linear);
  m.impl("packed_linear", &packed_linear);
}
