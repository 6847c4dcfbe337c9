/* batchgen: each row's argmax of a float32 (or, built as row_argmax_bf16.c, bfloat16) matrix, and whether any entry is NaN, on the CPU.
 *
 * Why in C: greedy decoding takes the argmax of every row of a step's logits, and torch's
 * max over the last dimension runs at a fraction of this CPU's bandwidth (~160 us for 64 rows of a
 * 4,096-token vocabulary read just after the forward), then the step's NaN check reads the row
 * maxima again. Here each row is read once for its maximum (vectorised, NaN noted on the way) and
 * once more from L1, up to the maximum, for the first index holding it (vectorised too: a scalar
 * search made the kernel as slow as torch's). See batchgen/engine/sampler.py (when it is used).
 *
 * Layout: x [rows, cols], rows ld elements apart, each row contiguous; ids [rows] int64.
 * ids[r] is the first index of row r's maximum, as torch.max(dim=-1) gives it (so a row of -inf
 * gives 0); for a row holding a NaN, the first NaN's index (torch's max propagates NaN).
 * Returns the number of rows holding a NaN.
 *
 * Built twice: here for float32, and by row_argmax_bf16.c (BATCHGEN_BF16) for bfloat16 logits,
 * each element widened to float32 as it is loaded (exact: a bf16 is a float32's upper half), so
 * the bf16 argmax is the argmax of the same logits converted to float32, with no float32 copy.
 */
#include <math.h>
#include <stdint.h>
#include "bf16.h"
#include <omp.h>

#ifdef BATCHGEN_BF16
typedef uint16_t elem_t;
#define ARGMAX_NAME batchgen_row_argmax_bf16
static inline float load(const elem_t *p) { return bf16_widen(*p); }
#else
typedef float elem_t;
#define ARGMAX_NAME batchgen_row_argmax
static inline float load(const elem_t *p) { return *p; }
#endif

/* below this many entries one thread does it all: waking the other costs more than it saves */
#define PARALLEL_MIN (1 << 16)
#define CHUNK 16 /* entries compared at once while looking for the maximum's index */

static inline float larger(float a, float b) { return b > a ? b : a; }

static int64_t row_argmax(const elem_t *row, int64_t cols, int *has_nan) {
  /* four quarters of the row at once: four independent maxima, so the vector max's latency
   * overlaps (one accumulator ran at half the speed) */
  const int64_t q = cols / 4;
  const elem_t *r1 = row + q, *r2 = row + 2 * q, *r3 = row + 3 * q;
  float t0 = -INFINITY, t1 = -INFINITY, t2 = -INFINITY, t3 = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : t0, t1, t2, t3) reduction(| : nan)
  for (int64_t c = 0; c < q; c++) {
    const float a = load(row + c), b = load(r1 + c), d = load(r2 + c), e = load(r3 + c);
    nan |= (a != a) | (b != b) | (d != d) | (e != e);
    t0 = larger(t0, a);
    t1 = larger(t1, b);
    t2 = larger(t2, d);
    t3 = larger(t3, e);
  }
  for (int64_t c = 4 * q; c < cols; c++) {
    const float a = load(row + c);
    nan |= a != a;
    t0 = larger(t0, a);
  }
  const float top = larger(larger(t0, t1), larger(t2, t3));
  *has_nan = nan;
  int64_t c = 0;
  if (nan) {
    while (load(row + c) == load(row + c)) c++;
    return c;
  }
  /* the first block of CHUNK holding the maximum (compared a vector at a time), then its entry */
  for (; c + CHUNK <= cols; c += CHUNK) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t j = 0; j < CHUNK; j++) hit |= load(row + c + j) == top;
    if (hit) break;
  }
  while (c < cols - 1 && load(row + c) != top) c++; /* found before the end: top is one of the row's values */
  return c;
}

int64_t ARGMAX_NAME(int64_t rows, int64_t cols, const elem_t *x, int64_t ld, int64_t *ids, int64_t threads) {
  int64_t nan_rows = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : nan_rows) if (rows * cols >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; r++) {
    int nan;
    ids[r] = row_argmax(x + r * ld, cols, &nan);
    nan_rows += nan;
  }
  return nan_rows;
}
