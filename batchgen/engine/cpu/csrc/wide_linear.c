/* batchgen: y = x @ w^T (+ bias) for tens of rows of x, on the CPU: the compute-bound end of decode sizes.
 *
 * Why a second kernel: at a few rows a linear layer is bound by reading its weights, which
 * skinny_linear.c does once, overlapped with the arithmetic. At tens of rows (a decode step of
 * 64 sequences) the multiply-adds bound it instead, and there skinny_linear.c's tiles, one vector
 * accumulator per (x row, w row) pair summed across its lanes at the end, spend a load of x per
 * few multiply-adds and the sums at every tile's end (the 57M model's linears at 64 rows: ~122
 * GFLOPS on an EPYC host where sgemm gave 92-123; benchmarks/RESULTS.md, issue 11's twelfth pass).
 *
 * Here x's rows are first transposed, once per call, into xt [k][mp] (mp: the rows rounded up to
 * a whole vector, zero padded), so one vector holds one input column for VW rows. Each weight
 * element is then broadcast and multiplied into the mv = mp / VW vectors of its column: NB weight
 * rows at a time (NB * mv accumulators, each holding VW outputs), no sum across lanes, one load of
 * x per NB broadcasts. Weight rows are still read once each, in place (no packed copy), each
 * thread walking its own contiguous range of them; xt stays in the core's L2 cache.
 *
 * Layout (float32): x [m, k] with rows ldx floats apart; w [n, k] contiguous; bias [n] or NULL;
 * y [m, n] contiguous. Rows are taken CHUNK at a time (mv <= 4).
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

typedef float vec __attribute__((vector_size(64), aligned(64)));
#define VW 16
#define CHUNK 64 /* rows of x per pass: 4 vectors */
#define MAX_ACC 24 /* accumulators a tile keeps in registers (of 32 on AVX-512, with mv loads and a broadcast) */

/* xt[c][i] = x[i][c] for the 16 columns from c0 and the rows [i0, i0 + 16) (rows >= m: zeros).
 * Element by element: __builtin_shufflevector, which an in-register transpose needs, exists from
 * GCC 12 only, and the transpose is O(rows x k) against the call's O(rows x n x k) */
static void transpose_block(const int64_t m, const int64_t i0, const int64_t c0, const float *x, const int64_t ldx,
                            float *xt, const int64_t mp) {
  for (int64_t i = 0; i < VW; i++) {
    const float *row = x + (i0 + i) * ldx + c0;
    for (int64_t c = 0; c < VW; c++) xt[(c0 + c) * mp + i0 + i] = i0 + i < m ? row[c] : 0.0f;
  }
}

/* this thread's share of xt for rows [0, m): whole 16-column blocks, and the columns past the last */
static void transpose_share(const int64_t m, const int64_t mp, const int64_t k, const float *x, const int64_t ldx,
                            float *xt, const int64_t t, const int64_t nt) {
  const int64_t blocks = k / VW;
  for (int64_t b = blocks * t / nt; b < blocks * (t + 1) / nt; b++)
    for (int64_t i0 = 0; i0 < mp; i0 += VW) transpose_block(m, i0, b * VW, x, ldx, xt, mp);
  if (t == nt - 1)
    for (int64_t c = blocks * VW; c < k; c++)
      for (int64_t i = 0; i < mp; i++) xt[c * mp + i] = i < m ? x[i * ldx + c] : 0.0f;
}

/* out[j][i] = x[i] . w[j] for j < nb, i < mv * VW: nb * mv accumulators over the k columns, each
 * weight element broadcast once; nb, mv are constants where it is inlined */
static inline __attribute__((always_inline)) void tile(const int nb, const int mv, const int64_t k, const int64_t mp,
                                                       const float *xt, const float *w, float out[][CHUNK]) {
  vec acc[MAX_ACC];
  for (int a = 0; a < nb * mv; a++) acc[a] = (vec){0};
  for (int64_t c = 0; c < k; c++) {
    vec xv[CHUNK / VW];
    for (int v = 0; v < mv; v++) xv[v] = *(const vec *)(xt + c * mp + v * VW);
    for (int j = 0; j < nb; j++) {
      const float s = w[j * k + c];
      for (int v = 0; v < mv; v++) acc[j * mv + v] += s * xv[v];
    }
  }
  for (int j = 0; j < nb; j++)
    for (int v = 0; v < mv; v++) *(vec *)(out[j] + v * VW) = acc[j * mv + v];
}

typedef void (*tile_fn)(int64_t, int64_t, const float *, const float *, float[][CHUNK]);
#define TILE_FN(NB, MV)                                                                                  \
  static void tile_##NB##_##MV(int64_t k, int64_t mp, const float *xt, const float *w, float out[][CHUNK]) { \
    tile(NB, MV, k, mp, xt, w, out);                                                                     \
  }
TILE_FN(16, 1) TILE_FN(12, 2) TILE_FN(8, 3) TILE_FN(6, 4)
TILE_FN(1, 1) TILE_FN(1, 2) TILE_FN(1, 3) TILE_FN(1, 4)
/* by mv: all of a tile's weight rows (MAX_ACC / mv of them, 16 with one vector), and one row */
static const tile_fn FULL[5] = {0, tile_16_1, tile_12_2, tile_8_3, tile_6_4};
static const tile_fn ONE[5] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4};
static const int64_t WIDTH[5] = {0, 16, 12, 8, 6};

/* y rows [0, m) (m <= CHUNK) against this thread's weight rows, from xt */
static void weight_share(const int64_t m, const int64_t mp, const int64_t n, const int64_t k, const float *xt,
                         const float *w, const float *bias, float *y, const int64_t t, const int64_t nt) {
  const int64_t mv = mp / VW, width = WIDTH[mv], blocks = (n + width - 1) / width;
  float out[MAX_ACC][CHUNK] __attribute__((aligned(64)));
  for (int64_t b = blocks * t / nt; b < blocks * (t + 1) / nt; b++) {
    const int64_t n0 = b * width, nb = n - n0 < width ? n - n0 : width;
    if (nb == width) FULL[mv](k, mp, xt, w + n0 * k, out);
    else for (int64_t j = 0; j < nb; j++) ONE[mv](k, mp, xt, w + (n0 + j) * k, out + j);
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < nb; j++) y[i * n + n0 + j] = bias ? out[j][i] + bias[n0 + j] : out[j][i];
  }
}

/* 0, or -1 for bad sizes, -2 when the transposed rows' scratch cannot be allocated */
int64_t batchgen_linear_wide(const int64_t m, const int64_t n, const int64_t k, const float *x, const int64_t ldx,
                             const float *w, const float *bias, float *y, const int64_t threads) {
  if (m < 1 || n < 1 || k < 1 || ldx < k || threads < 1) return -1;
  const int64_t rows = m < CHUNK ? m : CHUNK, cap = (rows + VW - 1) / VW * VW;
  /* aligned_alloc takes whole multiples of the alignment: cap is one of 16 floats (64 bytes) */
  float *xt = aligned_alloc(64, (size_t)(k * cap) * sizeof(float));
  if (!xt) return -2;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t i0 = 0; i0 < m; i0 += CHUNK) {
      const int64_t mc = m - i0 < CHUNK ? m - i0 : CHUNK, mp = (mc + VW - 1) / VW * VW;
      transpose_share(mc, mp, k, x + i0 * ldx, ldx, xt, t, nt);
#pragma omp barrier
      weight_share(mc, mp, n, k, xt, w, bias, y + i0 * n, t, nt);
#pragma omp barrier /* why: the next chunk overwrites xt */
    }
  }
  free(xt);
  return 0;
}
