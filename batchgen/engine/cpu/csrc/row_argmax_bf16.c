/* batchgen: row_argmax.c for bfloat16 logits (batchgen_row_argmax_bf16).
 *
 * Why the same source again: a bf16 model's logits are read in place, each element widened to
 * float32 as it is loaded (exact), so greedy needs no float32 copy of the step's logits and its
 * ids are those of the float32 kernel on the converted logits (ties: the first maximum).
 */
#define BATCHGEN_BF16 1
#include "row_argmax.c"
