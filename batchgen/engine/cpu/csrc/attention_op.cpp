// batchgen: the torch operator batchgen::attention, the CPU backend's attention call (eager or compiled).
//
// Why C++: in a decode-only step on the CPU every layer's attention is one call of the native decode
// kernel (csrc/decode_attention.c, float32 or its bf16 twin: the plan names which one), and the
// Python around that call (the custom op's dispatch, the step context, the checks, the kernel's
// per-layer arguments) cost ~0.1 ms a layer or more (the demo model's decode step of 64 sequences
// is 9.3 ms with it, 8.3 ms through here). Python sets a plan for such a step (the kernel's
// argument array with everything that holds for the step, each layer's pool, the step's slots, the
// kernel's address) and writes its address into the backend's plan cell, a table here indexed by the
// backend's handle, which every call carries (one cell per backend: several engines may live in one
// process; a handle, not the cell's address, so a compiled graph holds the same small constants in
// every process and inductor's graph cache can hit); each layer's call here then only writes that
// layer's tensors into the arguments and calls the kernel.
// Without a plan (a step with prefills, or one the plan does not cover) it calls the Python op
// batchgen::paged_attention with the same arguments, so every step still has one entry point.
// See batchgen/engine/cpu/front.py.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "decode_args.h"

namespace {

using kernel_fn = int64_t (*)(int64_t *, float);

// The plan's fields (P_*) and the kernel's arguments (A_*): decode_args.h, shared with the kernel
constexpr int64_t LAYER_ARGS = A_COUNT - A_Q;  // per-layer arguments, A_Q .. A_POOL_SLOTS

at::Tensor python_op(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, double scale,
                     std::optional<int64_t> window, std::optional<double> softcap, int64_t backend, int64_t layer) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("batchgen::paged_attention", "");
  torch::jit::Stack stack{query, key, value, scale, window, softcap, backend, layer};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// the plan's element type (its kernel reads float32 or bfloat16) on the CPU
bool cpu_of(const at::Tensor &t, at::ScalarType type) { return t.scalar_type() == type && t.device().is_cpu(); }

// D contiguous, as the kernel reads a head's vector
at::Tensor rows_contiguous(const at::Tensor &t) { return t.stride(2) == 1 ? t : t.contiguous(); }

// each live backend's current plan (its address; 0: none), by the backend's handle (cpu/front.py)
constexpr int64_t MAX_BACKENDS = 1024;
int64_t plan_cells[MAX_BACKENDS] = {};

// the last refusal's message, for Python to read: a compiled graph reports only that the call failed
thread_local std::string last_error;

at::Tensor planned(int64_t *plan, const at::Tensor &query, const at::Tensor &key, const at::Tensor &value,
                   double scale, std::optional<int64_t> window, std::optional<double> softcap, int64_t layer) {
  plan[P_CALLS]++;  // counted first: the runner checks every layer came through
  const int64_t n = plan[P_DECODES], heads = plan[P_HEADS], kvh = plan[P_KV_HEADS], d = plan[P_HEAD_DIM];
  TORCH_CHECK(layer >= 0 && layer < plan[P_LAYERS], "attention for layer ", layer, " of a plan for ", plan[P_LAYERS],
              " layers");
  TORCH_CHECK(!softcap.has_value(), "batchgen::attention: a decode plan for a layer that soft-caps its logits");
  // why checked here: the kernel reads and writes through raw addresses
  const at::ScalarType type = plan[P_BF16] ? at::kBFloat16 : at::kFloat;
  TORCH_CHECK(cpu_of(query, type) && cpu_of(key, type) && cpu_of(value, type) && query.dim() == 3 && key.dim() == 3,
              "batchgen::attention: ", plan[P_BF16] ? "bfloat16" : "float32", " CPU tensors [heads, tokens, dim] expected");
  const int64_t tokens = query.size(1);
  TORCH_CHECK(query.size(0) == heads && query.size(2) == d && tokens >= n && key.size(0) == kvh &&
                  key.size(1) == tokens && key.size(2) == d && value.sizes() == key.sizes(),
              "batchgen::attention: q ", query.sizes(), ", key ", key.sizes(), ", value ", value.sizes(), " for ", n,
              " decodes over ", heads, " heads, ", kvh, " K/V heads of ", d);
  const at::Tensor q = rows_contiguous(query), k = rows_contiguous(key), v = rows_contiguous(value);
  at::Tensor out = at::empty({tokens, heads, d}, query.options());
  int64_t *args = reinterpret_cast<int64_t *>(plan[P_ARGS]);
  const int64_t bases = plan[P_BASES] + layer * plan[P_LAYER_BYTES];
  const int64_t layer_args[LAYER_ARGS] = {
      reinterpret_cast<int64_t>(q.data_ptr()), q.stride(0), q.stride(1),
      reinterpret_cast<int64_t>(k.data_ptr()), k.stride(0), k.stride(1),
      reinterpret_cast<int64_t>(v.data_ptr()), v.stride(0), v.stride(1),
      bases, bases + plan[P_LAYERS] * plan[P_LAYER_BYTES], window.value_or(0),
      reinterpret_cast<int64_t>(out.data_ptr()), plan[P_POOLS + 2 * layer], plan[P_POOLS + 2 * layer + 1],
      plan[P_SLOTS], plan[P_POOL_SLOTS],
  };
  for (int64_t i = 0; i < LAYER_ARGS; i++) args[A_Q + i] = layer_args[i];
  const auto began = std::chrono::steady_clock::now();
  int64_t status;
  {
    // named as decode_native.PROFILE_NAME, as the Python path names its calls (free unless profiling)
    RECORD_FUNCTION("batchgen::native_decode_attention", c10::ArrayRef<const c10::IValue>{});
    status = reinterpret_cast<kernel_fn>(plan[P_KERNEL])(args, static_cast<float>(scale));
  }
  plan[P_NANOS] += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - began).count();
  TORCH_CHECK_WITH(OutOfMemoryError, status != -3, "native decode attention: no memory for the work list of ", n,
                   " decodes");
  TORCH_CHECK(status != -1, "native decode attention refused ", heads / kvh, " query heads per KV head, head dim ", d);
  TORCH_CHECK(status == 0, "native decode attention refused layer ", layer, ": a decode longer than its row, a shared ",
              "prefix not shorter than its decode, a class or row outside its tensors, or a slot outside the pool");
  if (tokens > plan[P_TOKENS]) out.narrow(0, plan[P_TOKENS], tokens - plan[P_TOKENS]).zero_();
  return out;
}

// backend: the handle of the backend the call is for; its cell holds its current plan (0: none)
at::Tensor attention(const at::Tensor &query, const at::Tensor &key, const at::Tensor &value, double scale,
                     std::optional<int64_t> window, std::optional<double> softcap, int64_t backend, int64_t layer) {
  const bool celled = backend >= 0 && backend < MAX_BACKENDS;
  int64_t *plan = celled ? reinterpret_cast<int64_t *>(plan_cells[backend]) : nullptr;
  if (plan == nullptr) return python_op(query, key, value, scale, window, softcap, backend, layer);
  try {
    return planned(plan, query, key, value, scale, window, softcap, layer);
  } catch (const c10::Error &e) {
    last_error = e.what_without_backtrace();
    throw;
  }
}

}  // namespace

// the last refusal's message since the last call (NULL: none), forgotten once taken
extern "C" const char *batchgen_attention_op_take_error(void) {
  static thread_local std::string taken;
  taken.swap(last_error);
  last_error.clear();
  return taken.empty() ? nullptr : taken.c_str();
}

// the plan cells (MAX_BACKENDS of them) for Python to write each backend's plan into
extern "C" int64_t *batchgen_attention_op_plan_cells(void) { return plan_cells; }
extern "C" int64_t batchgen_attention_op_max_backends(void) { return MAX_BACKENDS; }

// the names of the plan's fields and of the kernel's arguments, in order (Python checks them at load)
extern "C" const char *batchgen_attention_op_plan_names(void) { return BATCHGEN_PLAN_FIELDS(BATCHGEN_NAME); }
extern "C" const char *batchgen_attention_op_arg_names(void) { return BATCHGEN_DECODE_ARGS(BATCHGEN_NAME); }

// the schema and the fake (shape-only) implementation are defined in batchgen/engine/attention/op.py
TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("attention", &attention); }
