/* batchgen: decode_attention.c for bfloat16 models (rows, queries, pools and output in bf16).
 *
 * Why the same source again: a bf16 model's decode attention is the same walk over the same rows,
 * only with elements half as wide; each one is widened to float32 as it is loaded (exact), every
 * score, softmax and sum stays float32, and the output is rounded once, to nearest even. Half the
 * bytes read per position is what a memory-bound decode gains. Its exported names end in _bf16
 * (batchgen_decode_attention_bf16, batchgen_fill_row_bf16); see decode_native.py.
 */
#define BATCHGEN_BF16 1
#include "decode_attention.c"
