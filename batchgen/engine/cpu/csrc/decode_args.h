/* batchgen: the native decode attention's argument array and the C++ front's plan, named once.
 *
 * Why a header: decode_attention.c reads its arguments from one int64 array by index, and the C++
 * front (attention_op.cpp) writes each layer's part of that array and reads a plan array that
 * Python fills. The indices are defined here, once, for both C sides; each library also exports the
 * names in order (batchgen_decode_attention_arg_names, batchgen_attention_op_plan_names), and
 * Python refuses a library whose names differ from its own tuples (native.DECODE_ARGS,
 * decode_native.PLAN_FIELDS), so no side reads another's array by a stale index.
 */
#ifndef BATCHGEN_DECODE_ARGS_H
#define BATCHGEN_DECODE_ARGS_H

/* The kernel's arguments, all int64 (counts, strides in floats, and addresses). Set once per step:
 * N, THREADS, then per class or per decode the int64 arrays KSTRIDE .. SHARED (per decode: CLS,
 * ROW, CAP, LEN, SHARED), CLASSES (how many) and ROWS (per class: rows its tensors hold from the
 * row that KBASE / VBASE point at). Set on a step's first call: the model's shapes. Set per layer:
 * Q .. POOL_SLOTS (q: decode i's query head j at q + i * q_token + j * q_head; this step's K/V
 * strided like q). */
#define BATCHGEN_DECODE_ARGS(X)                                                                          \
  X(N) X(THREADS) X(KSTRIDE) X(VSTRIDE) X(CLS) X(ROW) X(CAP) X(LEN) X(SHARED) X(CLASSES) X(ROWS)       \
  X(KVH) X(G) X(D) X(SCRATCH) X(SCRATCH_STRIDE)                                                          \
  X(Q) X(Q_HEAD) X(Q_TOKEN) X(KNEW) X(K_HEAD) X(K_TOKEN) X(VNEW) X(V_HEAD) X(V_TOKEN)                   \
  X(KBASE) X(VBASE) X(WINDOW) X(OUT) X(KPOOL) X(VPOOL) X(SLOT) X(POOL_SLOTS)

/* The C++ front's plan (an int64 array owned by Python), then per layer the key pool's and the
 * value pool's addresses:
 *   ARGS: the kernel's argument array, the step's part filled (the front writes A_Q on); LAYERS, DECODES (tokens 0..n-1), TOKENS (real tokens; rows past them
 *   are padding, zeroed), HEADS, KV_HEADS, HEAD_DIM; BASES: layer 0's key-class addresses (the value
 *   ones follow all layers' keys); LAYER_BYTES between one layer's class addresses and the next's;
 *   SLOTS: the step's slot mapping (int64, one per decode at least); POOL_SLOTS in one layer's pool;
 *   CALLS: layers attended so far and NANOS spent in the kernel (both written by the front); KERNEL:
 *   the address of the kernel to call (batchgen_decode_attention, or its _bf16 twin), BF16: 1 when
 *   the step's tensors are bfloat16 (0: float32). */
#define BATCHGEN_PLAN_FIELDS(X)                                                                          \
  X(ARGS) X(LAYERS) X(DECODES) X(TOKENS) X(HEADS) X(KV_HEADS) X(HEAD_DIM) X(BASES)          \
  X(LAYER_BYTES) X(SLOTS) X(POOL_SLOTS) X(CALLS) X(NANOS) X(KERNEL) X(BF16)

#define BATCHGEN_INDEX_A(name) A_##name,
#define BATCHGEN_INDEX_P(name) P_##name,
#define BATCHGEN_NAME(name) #name " "
enum { BATCHGEN_DECODE_ARGS(BATCHGEN_INDEX_A) A_COUNT };
enum { BATCHGEN_PLAN_FIELDS(BATCHGEN_INDEX_P) P_POOLS };

#endif
