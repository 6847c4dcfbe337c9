/* batchgen: y = x @ w^T (+ bias) in bf16 for a few to tens of rows, on a weight packed once for vdpbf16ps.
 *
 * Why: AVX512-BF16's vdpbf16ps multiplies 16 pairs of bf16 and adds each pair's two products into one
 * float32 lane. Fed a weight in nn.Linear's [n, k] layout, a kernel must either sum lanes at the end of
 * each dot product (skinny_linear_bf16.c) or reorder the weight on every call (oneDNN's bf16 GEMM at
 * decode sizes). Packed once, at load, into pairs interleaved by output column, each 64-byte load of
 * weight is 16 output columns x one pair of k, and one broadcast pair of an x row meets it: the
 * accumulators are output columns, never summed across lanes.
 *
 * Packed layout: panels of NR output columns; panel p holds, for each pair q of k (k/2 rounded up),
 * NR columns x 2 bf16: packed[((p * KP + q) * NR + c) * 2 + e] = w[p * NR + c][2q + e], zero past n or
 * k. Where n is a multiple of NR and k even it has exactly the weight's size.
 *
 * Tiles: MR rows x NR columns (MR * NR / 16 accumulators) over a chunk of KC pairs; the chunk's
 * partial sums wait in a per-thread float32 scratch [m][NR] between chunks, so the weight chunk stays
 * in the L1/L2 cache while every row block meets it. Threads split the panels (contiguous ranges).
 * Float32 accumulation; y rounded once to bf16 (nearest even) or left float32 (y_float != 0).
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere (an
 * AVX2 build, another architecture) batchgen_vnni_panel returns 0 and the others refuse (-1), so a
 * host without vdpbf16ps never packs a weight. See batchgen/engine/cpu/packed_linear.py.
 */
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <omp.h>
#include <stdlib.h>

#ifndef NR
#define NR 64
#endif
#ifndef MR
#define MR 6
#endif
#ifndef KC
#define KC 256
#endif
#define NV (NR / 16)

int64_t batchgen_vnni_panel(void) { return NR; }

/* how many bf16 elements the packed weight holds */
int64_t batchgen_vnni_packed_size(const int64_t n, const int64_t k) { return (n + NR - 1) / NR * ((k + 1) / 2) * NR * 2; }

/* w [n, k] bf16 -> packed (batchgen_vnni_packed_size elements) */
int64_t batchgen_vnni_pack(const int64_t n, const int64_t k, const uint16_t *w, uint16_t *packed, const int64_t threads) {
  if (n < 1 || k < 1 || threads < 1) return -1;
  const int64_t kp = (k + 1) / 2, panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels; p++)
    for (int64_t q = 0; q < kp; q++) {
      uint16_t *out = packed + (p * kp + q) * NR * 2;
      for (int64_t c = 0; c < NR; c++) {
        const int64_t col = p * NR + c;
        for (int64_t e = 0; e < 2; e++) {
          const int64_t kk = 2 * q + e;
          out[c * 2 + e] = col < n && kk < k ? w[col * k + kk] : 0;
        }
      }
    }
  return 0;
}

typedef int32_t pair_t __attribute__((aligned(2), may_alias));

/* rows [0, mr) of x against one panel's pairs [q0, q1): acc from scratch (or zero where first), then
 * to scratch, or (last) to y with the bias. x points at row 0 of the block, y likewise; cols: the
 * panel's columns that exist (<= NR). half: the chunk ends on k's odd last element. */
static inline __attribute__((always_inline)) void tile(const int mr, const uint16_t *x, const int64_t ldx,
                                                       const uint16_t *wp, const int64_t q0, const int64_t q1,
                                                       const int half, float *scratch, const int first,
                                                       const int last, const uint16_t *bias, void *y,
                                                       const int64_t ldy, const int y_float, const int64_t cols) {
  __m512 acc[MR][NV];
  for (int i = 0; i < mr; i++)
    for (int v = 0; v < NV; v++) acc[i][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(scratch + i * NR + v * 16);
  const uint16_t *w = wp + q0 * NR * 2;
  for (int64_t q = q0; q < q1; q++, w += NR * 2) {
    __m512bh wv[NV];
    for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512((const void *)(w + v * 32));
    for (int i = 0; i < mr; i++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(*(const pair_t *)(x + i * ldx + 2 * q));
      for (int v = 0; v < NV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xv, wv[v]);
    }
  }
  if (half) { /* k odd: the last pair is (x[k-1], 0); x[k] is never read */
    __m512bh wv[NV];
    for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512((const void *)(w + v * 32));
    for (int i = 0; i < mr; i++) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32((int32_t)x[i * ldx + 2 * q1]);
      for (int v = 0; v < NV; v++) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xv, wv[v]);
    }
  }
  if (!last) {
    for (int i = 0; i < mr; i++)
      for (int v = 0; v < NV; v++) _mm512_storeu_ps(scratch + i * NR + v * 16, acc[i][v]);
    return;
  }
  for (int v = 0; v < NV; v++) {
    const int64_t left = cols - v * 16;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    __m512 b = _mm512_setzero_ps(); /* the bias widened to float32 (exact) */
    if (bias) b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + v * 16)), 16));
    for (int i = 0; i < mr; i++) {
      const __m512 s = _mm512_add_ps(acc[i][v], b);
      if (y_float) _mm512_mask_storeu_ps((float *)y + i * ldy + v * 16, mask, s);
      else _mm256_mask_storeu_epi16((uint16_t *)y + i * ldy + v * 16, mask, (__m256i)_mm512_cvtneps_pbh(s));
    }
  }
}

typedef void (*tile_fn)(const uint16_t *, int64_t, const uint16_t *, int64_t, int64_t, int, float *, int, int,
                        const uint16_t *, void *, int64_t, int, int64_t);
#define TILE_FN(M)                                                                                          \
  static void tile_##M(const uint16_t *x, int64_t ldx, const uint16_t *wp, int64_t q0, int64_t q1, int half, \
                       float *scratch, int first, int last, const uint16_t *bias, void *y, int64_t ldy,     \
                       int y_float, int64_t cols) {                                                         \
    tile(M, x, ldx, wp, q0, q1, half, scratch, first, last, bias, y, ldy, y_float, cols);                   \
  }
TILE_FN(1) TILE_FN(2) TILE_FN(3) TILE_FN(4) TILE_FN(5) TILE_FN(6)
#if MR > 6
TILE_FN(7) TILE_FN(8)
#endif
#if MR > 8
TILE_FN(9) TILE_FN(10) TILE_FN(11) TILE_FN(12)
#endif
static const tile_fn TILES[] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6,
#if MR > 6
                                tile_7, tile_8,
#endif
#if MR > 8
                                tile_9, tile_10, tile_11, tile_12
#endif
};

/* y [m, n] (ldy n) = x [m, k] (rows ldx apart) @ w^T + bias, w packed by batchgen_vnni_pack; bias [n]
 * bf16 or NULL; y bf16, or float32 where y_float. 0, or -1 on bad arguments / no memory. */
int64_t batchgen_vnni_linear(const int64_t m, const int64_t n, const int64_t k, const uint16_t *x, const int64_t ldx,
                             const uint16_t *packed, const uint16_t *bias, void *y, const int64_t y_float,
                             const int64_t threads) {
  if (m < 1 || n < 1 || k < 1 || ldx < k || threads < 1) return -1;
  const int64_t kp = (k + 1) / 2, full = k / 2, panels = (n + NR - 1) / NR;
  const int64_t elem = y_float ? 4 : 2;
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t first = panels * t / nt, end = panels * (t + 1) / nt;
    float *scratch = full > KC ? malloc(sizeof(float) * m * NR) : 0;
    if (full > KC && !scratch) {
#pragma omp atomic write
      failed = 1;
    } else {
      for (int64_t p = first; p < end; p++) {
        const uint16_t *wp = packed + p * kp * NR * 2;
        const int64_t n0 = p * NR, cols = n - n0 < NR ? n - n0 : NR;
        for (int64_t q0 = 0; q0 < full || q0 == 0; q0 += KC) {
          const int64_t q1 = q0 + KC < full ? q0 + KC : full;
          const int last = q1 == full, half = last && (k & 1);
          for (int64_t i = 0; i < m; i += MR) {
            const int mr = m - i < MR ? (int)(m - i) : MR;
            TILES[mr](x + i * ldx, ldx, wp, q0, q1, half, scratch ? scratch + i * NR : 0, q0 == 0, last, bias ? bias + n0 : 0,
                      (char *)y + (i * n + n0) * elem, n, (int)y_float, cols);
          }
          if (last) break;
        }
      }
    }
    free(scratch);
  }
  (void)kp;
  return failed ? -1 : 0;
}
#else
int64_t batchgen_vnni_panel(void) { return 0; }
int64_t batchgen_vnni_packed_size(const int64_t n, const int64_t k) {
  (void)n, (void)k;
  return -1;
}
int64_t batchgen_vnni_pack(const int64_t n, const int64_t k, const uint16_t *w, uint16_t *packed, const int64_t threads) {
  (void)n, (void)k, (void)w, (void)packed, (void)threads;
  return -1;
}
int64_t batchgen_vnni_linear(const int64_t m, const int64_t n, const int64_t k, const uint16_t *x, const int64_t ldx,
                             const uint16_t *packed, const uint16_t *bias, void *y, const int64_t y_float,
                             const int64_t threads) {
  (void)m, (void)n, (void)k, (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)y_float, (void)threads;
  return -1;
}
#endif
