/* batchgen: y = x @ w^T (+ bias) for a few rows of x, on the CPU: a linear layer at decode sizes.
 *
 * Why not the BLAS: at decode sizes a float32 sgemm on nn.Linear's [out, in] weights is far from
 * the one read of the weights such a call is bound by (the 57M model's 56 linears: ~7.5 ms a step
 * for one row, 16.1 ms for 8 rows; benchmarks/RESULTS.md, issue 11's seventh pass). Here every
 * weight row is read once per call, in place (no packed copy, no extra memory), against all rows of
 * x: MB rows of x against NB rows of w at a time, one vector accumulator per (x row, w row) pair,
 * summed across its lanes at the end. Each thread walks its own contiguous range of weight rows,
 * NB at a time; while the blocks of x rows meet those (in cache after the first block), the next
 * NB rows are prefetched from memory a share per block, so reading the weights overlaps with the
 * multiply-adds (8 rows: 8.7-9.0 ms; 64 rows 29 ms against sgemm's 30-32). From WIDE_MIN_ROWS rows,
 * where the multiply-adds rather than the reads bound a call, wide_linear.c takes it instead. See
 * batchgen/engine/native_linear.py (when it is used).
 *
 * Layout (float32, or bfloat16 where built with BATCHGEN_BF16): x [m, k] with rows ldx floats apart; w [n, k] contiguous; bias [n] or NULL;
 * y [m, n] contiguous.
 */
#include <stdint.h>
#include "bf16.h"
#include <omp.h>

/* 16 floats: one 512-bit register where the CPU has them; gcc splits it into two or four elsewhere */
typedef float vec __attribute__((vector_size(64), aligned(4), may_alias));
#define VW 16

/* The element type of x, w, bias and y: float32 here; skinny_linear_bf16.c includes this file with
 * BATCHGEN_BF16 defined for bfloat16 ones. Every multiply-add and sum stays float32: VW bf16
 * elements are widened to a float vector as they are loaded (exactly), and y is rounded once. */
#ifdef BATCHGEN_BF16
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
typedef uint16_t elem;
typedef uint16_t hvec __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t uvec __attribute__((vector_size(64)));
static inline __attribute__((always_inline)) vec load_vec(const elem *p) {
  return (vec)(__builtin_convertvector(*(const hvec *)p, uvec) << 16);
}
#define LD(x) bf16_widen(x)
#define ST(x) bf16_round(x)
#define EXPORT(name) name##_bf16
#else
typedef float elem;
#define load_vec(p) (*(const vec *)(p))
#define LD(x) (x)
#define ST(x) (x)
#define EXPORT(name) name
#endif
/* how far ahead (floats) each streamed weight row is prefetched: 512 bytes, measured best of
 * 0/256/512/1024 bytes (8 rows x the 57M model's linears: 11.5 -> 10.0 ms) */
#define AHEAD 128
#define MAX_MB 6
#define MAX_NB 8

/* the 16 lanes' sum, pairwise (halves, then quarters); lane by lane, since __builtin_shufflevector
 * needs GCC 12 and the kernels must build with GCC 11 (Ubuntu 22.04, RHEL 9) */
static inline __attribute__((always_inline)) float lane_sum(vec v) {
  float a[8], b[4];
  for (int i = 0; i < 8; i++) a[i] = v[i] + v[i + 8];
  for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

/* y[i][j] = x[i] . w[j] (+ bias[j]) for i < mb, j < nb: mb * nb independent accumulator chains,
 * each weight vector loaded once and used mb times; mb, nb are constants where it is inlined.
 * Also fetches pf_lines cache lines (VW floats each) from pf into L2, one per step of the loop. */
static inline __attribute__((always_inline)) void tile(const int mb, const int nb, const int64_t k,
                                                       const elem *x, const int64_t ldx, const elem *w,
                                                       const elem *bias, elem *y, const int64_t ldy,
                                                       const elem *pf, int64_t pf_lines) {
  vec acc[MAX_MB][MAX_NB];
  for (int i = 0; i < mb; i++)
    for (int j = 0; j < nb; j++) acc[i][j] = (vec){0};
  int64_t c = 0;
#if defined(BATCHGEN_BF16) && defined(__AVX512BF16__)
  /* AVX512-BF16: one vdpbf16ps takes 32 bf16 pairs of x and w (products exact in float32, summed into
   * 16 float32 lanes), so no widening and twice the multiply-adds of float32 per instruction; the
   * lanes are summed at the end as below. Chosen at build time, as -march=native finds the CPU. */
  for (; c + 2 * VW <= k; c += 2 * VW) {
    __m512bh wv[MAX_NB];
    for (int j = 0; j < nb; j++) {
      wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + j * k + c));
      __builtin_prefetch(w + j * k + c + 2 * AHEAD);
    }
    if (pf_lines > 0) {
      __builtin_prefetch(pf, 0, 2);
      pf += VW;
      pf_lines--;
    }
    for (int i = 0; i < mb; i++) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * ldx + c));
      for (int j = 0; j < nb; j++) acc[i][j] = (vec)_mm512_dpbf16_ps((__m512)acc[i][j], xv, wv[j]);
    }
  }
#endif
  for (; c + VW <= k; c += VW) {
    vec wv[MAX_NB];
    for (int j = 0; j < nb; j++) {
      wv[j] = load_vec(w + j * k + c);
      __builtin_prefetch(w + j * k + c + AHEAD);
    }
    if (pf_lines > 0) {
      __builtin_prefetch(pf, 0, 2);
      pf += VW;
      pf_lines--;
    }
    for (int i = 0; i < mb; i++) {
      const vec xv = load_vec(x + i * ldx + c);
      for (int j = 0; j < nb; j++) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < mb; i++)
    for (int j = 0; j < nb; j++) {
      float s = lane_sum(acc[i][j]);
      for (int64_t t = c; t < k; t++) s += LD(x[i * ldx + t]) * LD(w[j * k + t]);
      y[i * ldy + j] = ST(bias ? s + LD(bias[j]) : s);
    }
}

typedef void (*tile_fn)(int64_t, const elem *, int64_t, const elem *, const elem *, elem *, int64_t, const elem *,
                        int64_t);
#define TILE_FN(MB, NB)                                                                              \
  static void tile_##MB##_##NB(int64_t k, const elem *x, int64_t ldx, const elem *w, const elem *bias, \
                               elem *y, int64_t ldy, const elem *pf, int64_t pf_lines) {               \
    tile(MB, NB, k, x, ldx, w, bias, y, ldy, pf, pf_lines);                                              \
  }
TILE_FN(1, 8) TILE_FN(2, 8) TILE_FN(3, 8)
TILE_FN(1, 4) TILE_FN(2, 4) TILE_FN(3, 4) TILE_FN(4, 4) TILE_FN(5, 4) TILE_FN(6, 4)
TILE_FN(1, 1) TILE_FN(2, 1) TILE_FN(3, 1) TILE_FN(4, 1) TILE_FN(5, 1) TILE_FN(6, 1)
/* by the number of x rows: with up to 3, eight weight rows at once (8-24 chains); else four */
static const tile_fn WIDE[4] = {0, tile_1_8, tile_2_8, tile_3_8};
static const tile_fn FOUR[MAX_MB + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4};
static const tile_fn ONE[MAX_MB + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};

/* all m rows of x against weight rows [n0, n0 + nb), nb <= 8 (m <= 3) or 4. Rows [n0 + nb, next_end)
 * are what this thread reads next: while the blocks of x rows meet these weights (in cache after
 * the first block), those are fetched from memory into L2, a share per block, so reading the
 * weights overlaps with the multiply-adds instead of preceding them */
static void weight_rows(const int64_t m, const int64_t n, const int64_t k, const elem *x, const int64_t ldx,
                        const elem *w, const elem *bias, elem *y, const int64_t n0, const int64_t nb,
                        const int64_t next_end) {
  const elem *wr = w + n0 * k;
  const elem *br = bias ? bias + n0 : 0;
  if (m <= 3) {
    if (nb == 8) WIDE[m](k, x, ldx, wr, br, y + n0, n, 0, 0);
    else for (int64_t j = 0; j < nb; j++) ONE[m](k, x, ldx, wr + j * k, br ? br + j : 0, y + n0 + j, n, 0, 0);
    return;
  }
  const int64_t blocks = (m + MAX_MB - 1) / MAX_MB;
  const int64_t next_rows = next_end - (n0 + nb) < nb ? next_end - (n0 + nb) : nb;
  const int64_t lines = next_rows > 0 ? next_rows * k / VW : 0, share = (lines + blocks - 1) / blocks;
  const elem *next = w + (n0 + nb) * k;
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t i = b * MAX_MB, mb = m - i < MAX_MB ? m - i : MAX_MB;
    const int64_t from = b * share < lines ? b * share : lines, count = lines - from < share ? lines - from : share;
    if (nb == 4) {
      FOUR[mb](k, x + i * ldx, ldx, wr, br, y + i * n + n0, n, next + from * VW, count);
    } else {
      for (int64_t j = 0; j < nb; j++) ONE[mb](k, x + i * ldx, ldx, wr + j * k, br ? br + j : 0, y + i * n + n0 + j, n, 0, 0);
    }
  }
}

#ifndef BATCHGEN_BF16
/* wide_linear.c: the same product for tens of rows, where the multiply-adds bound it */
int64_t batchgen_linear_wide(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx, const float *w,
                             const float *bias, float *y, int64_t threads);
#endif
/* rows from which wide_linear.c takes the call: it pads rows to whole vectors of 16, so from 17 to 23
 * rows it does 32 rows' work and the tiles here were faster (20 rows: 20.6 against 21.1 ms for the
 * 57M model's linears); at 24 they tied, from 28 it was ahead (64 rows: 57-62 -> 38-40 ms) */
#define WIDE_MIN_ROWS 24

/* bf16: no wide kernel (at tens of rows the multiply-adds bound a call, and oneDNN's bf16 dot
 * products do twice as many per cycle as these float32 ones), so the tiles take every row count
 * and the calibration keeps the row counts where torch wins on torch */
int64_t EXPORT(batchgen_linear)(const int64_t m, const int64_t n, const int64_t k, const elem *x, const int64_t ldx,
                                const elem *w, const elem *bias, elem *y, const int64_t threads) {
  if (m < 1 || n < 1 || k < 1 || ldx < k || threads < 1) return -1;
#ifndef BATCHGEN_BF16
  if (m >= WIDE_MIN_ROWS) return batchgen_linear_wide(m, n, k, x, ldx, w, bias, y, threads);
#endif
  const int64_t width = m <= 3 ? 8 : 4;
  const int64_t blocks = (n + width - 1) / width;
  /* each thread takes one contiguous range of weight rows, so the rows it prefetches are its own */
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t first = blocks * t / nt, last = blocks * (t + 1) / nt;
    const int64_t end = last * width < n ? last * width : n;
    for (int64_t b = first; b < last; b++) {
      const int64_t n0 = b * width, left = n - n0;
      weight_rows(m, n, k, x, ldx, w, bias, y, n0, left < width ? left : width, end);
    }
  }
  return 0;
}
