/* batchgen: y = x @ w^T (+ bias) for a few rows of x, on the CPU: a linear layer at decode sizes.
 *
 * Why not the BLAS: at 4-24 rows a float32 sgemm on nn.Linear's [out, in] weights is far from the
 * one read of the weights such a call is bound by (the 57M model's 56 linears: ~7.5 ms a step for
 * one row, 16.1 ms for 8 rows; benchmarks/RESULTS.md, issue 11's seventh pass). Here every weight
 * row is read once per call, in place (no packed copy, no extra memory), against all rows of x:
 * MB rows of x against NB rows of w at a time, one vector accumulator per (x row, w row) pair,
 * summed across its lanes at the end (8 rows: 10.8-11.4 ms). A thread takes PANEL weight rows at
 * a time, which stay in cache while every block of x rows meets them. See
 * batchgen/engine/native_linear.py (when it is used).
 *
 * Layout (float32): x [m, k] with rows ldx floats apart; w [n, k] contiguous; bias [n] or NULL;
 * y [m, n] contiguous. Threads split the rows of w.
 */
#include <stdint.h>
#include <omp.h>

/* 16 floats: one 512-bit register where the CPU has them; gcc splits it into two or four elsewhere */
typedef float vec __attribute__((vector_size(64), aligned(4), may_alias));
#define VW 16
/* how far ahead (floats) each streamed weight row is prefetched: 512 bytes, measured best of
 * 0/256/512/1024 bytes (8 rows x the 57M model's linears: 11.5 -> 10.0 ms) */
#define AHEAD 128
#define MAX_MB 6
#define MAX_NB 8
#ifndef PANEL
#define PANEL 64 /* weight rows a thread takes at a time */
#endif

static inline __attribute__((always_inline)) float lane_sum(vec v) {
  typedef float half __attribute__((vector_size(32)));
  typedef float quarter __attribute__((vector_size(16)));
  half a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  quarter b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

/* y[i][j] = x[i] . w[j] (+ bias[j]) for i < mb, j < nb: mb * nb independent accumulator chains,
 * each weight vector loaded once and used mb times; mb, nb are constants where it is inlined */
static inline __attribute__((always_inline)) void tile(const int mb, const int nb, const int64_t k,
                                                       const float *x, const int64_t ldx, const float *w,
                                                       const float *bias, float *y, const int64_t ldy) {
  vec acc[MAX_MB][MAX_NB];
  for (int i = 0; i < mb; i++)
    for (int j = 0; j < nb; j++) acc[i][j] = (vec){0};
  int64_t c = 0;
  for (; c + VW <= k; c += VW) {
    vec wv[MAX_NB];
    for (int j = 0; j < nb; j++) {
      wv[j] = *(const vec *)(w + j * k + c);
      __builtin_prefetch(w + j * k + c + AHEAD);
    }
    for (int i = 0; i < mb; i++) {
      const vec xv = *(const vec *)(x + i * ldx + c);
      for (int j = 0; j < nb; j++) acc[i][j] += xv * wv[j];
    }
  }
  for (int i = 0; i < mb; i++)
    for (int j = 0; j < nb; j++) {
      float s = lane_sum(acc[i][j]);
      for (int64_t t = c; t < k; t++) s += x[i * ldx + t] * w[j * k + t];
      y[i * ldy + j] = bias ? s + bias[j] : s;
    }
}

typedef void (*tile_fn)(int64_t, const float *, int64_t, const float *, const float *, float *, int64_t);
#define TILE_FN(MB, NB)                                                                                 \
  static void tile_##MB##_##NB(int64_t k, const float *x, int64_t ldx, const float *w, const float *bias, \
                               float *y, int64_t ldy) {                                                  \
    tile(MB, NB, k, x, ldx, w, bias, y, ldy);                                                            \
  }
TILE_FN(1, 8) TILE_FN(2, 8) TILE_FN(3, 8)
TILE_FN(1, 4) TILE_FN(2, 4) TILE_FN(3, 4) TILE_FN(4, 4) TILE_FN(5, 4) TILE_FN(6, 4)
TILE_FN(1, 1) TILE_FN(2, 1) TILE_FN(3, 1) TILE_FN(4, 1) TILE_FN(5, 1) TILE_FN(6, 1)
/* by the number of x rows: with up to 3, eight weight rows at once (8-24 chains); else four */
static const tile_fn WIDE[4] = {0, tile_1_8, tile_2_8, tile_3_8};
static const tile_fn FOUR[MAX_MB + 1] = {0, tile_1_4, tile_2_4, tile_3_4, tile_4_4, tile_5_4, tile_6_4};
static const tile_fn ONE[MAX_MB + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1};

/* all m rows of x against weight rows [n0, n0 + nb): 6 rows of x at a time (in L1) against the
 * panel's rows 4 at a time (the panel stays in L2 across the row blocks); nb <= PANEL */
static void panel(const int64_t m, const int64_t n, const int64_t k, const float *x, const int64_t ldx,
                  const float *w, const float *bias, float *y, const int64_t n0, const int64_t nb) {
  if (m <= 3) {
    int64_t j = 0;
    for (; j + 8 <= nb; j += 8) WIDE[m](k, x, ldx, w + (n0 + j) * k, bias ? bias + n0 + j : 0, y + n0 + j, n);
    for (; j < nb; j++) ONE[m](k, x, ldx, w + (n0 + j) * k, bias ? bias + n0 + j : 0, y + n0 + j, n);
    return;
  }
  for (int64_t i = 0; i < m; i += MAX_MB) {
    const int64_t mb = m - i < MAX_MB ? m - i : MAX_MB;
    const float *xi = x + i * ldx;
    float *yi = y + i * n;
    int64_t j = 0;
    for (; j + 4 <= nb; j += 4) FOUR[mb](k, xi, ldx, w + (n0 + j) * k, bias ? bias + n0 + j : 0, yi + n0 + j, n);
    for (; j < nb; j++) ONE[mb](k, xi, ldx, w + (n0 + j) * k, bias ? bias + n0 + j : 0, yi + n0 + j, n);
  }
}

int64_t batchgen_linear(const int64_t m, const int64_t n, const int64_t k, const float *x, const int64_t ldx,
                        const float *w, const float *bias, float *y, const int64_t threads) {
  if (m < 1 || n < 1 || k < 1 || ldx < k || threads < 1) return -1;
  const int64_t panels = (n + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels; p++) {
    const int64_t n0 = p * PANEL, left = n - n0;
    panel(m, n, k, x, ldx, w, bias, y, n0, left < PANEL ? left : PANEL);
  }
  return 0;
}
