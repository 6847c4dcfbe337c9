/* batchgen: skinny_linear.c for bfloat16 linears (x, w, bias and y in bf16): batchgen_linear_bf16.
 *
 * Why: at decode sizes a linear layer is bound by reading its weights, and bf16 weights are half the
 * bytes; each weight and input vector is widened to float32 as it is loaded, every multiply-add and
 * sum stays float32 (as oneDNN's bf16 linear accumulates), and each output is rounded once, to
 * nearest even. Whether a bf16 model's linears take it, at which row counts, is measured per machine
 * and shape against torch's bf16 linear (linear_calibration, keyed by dtype).
 */
#define BATCHGEN_BF16 1
#include "skinny_linear.c"
