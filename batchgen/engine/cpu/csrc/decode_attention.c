/* batchgen: one layer's decode attention over contiguous per-sequence rows, on the CPU.
 *
 * Why in C: a decode step's attention in torch is a handful of ops per group of similar
 * lengths per layer (append, scores, softmax, output), each padded to the group's longest row.
 * Here one call per layer appends the step's K/V to every row and attends every (sequence,
 * KV head) pair over exactly its own keys, with OpenMP across pairs: no padding, no Python
 * per group, and the query heads that share a KV head read each key and value once.
 * See batchgen/engine/native.py (build, load, call) and decode_rows.py (the row layout).
 *
 * Layout (float32, or bfloat16 where built with BATCHGEN_BF16; all contiguous unless said):
 *   q            [kvh * g, tokens, d] the decodes' queries (strided, d contiguous; the decodes are
 *                                   tokens 0..n-1); query head h * g + j reads KV head h
 *   knew, vnew   [kvh, tokens, d]   this step's keys and values (strided the same way), stored at
 *                                   position len[i] - 1
 *   decode i's row is row[i] rows on from kbase[c] / vbase[c], where the tensors of its length class
 *   cls[i] for this layer hold the class's first row of the step (keys [rows, kvh, cap / TILE, d,
 *   TILE]: tiles of TILE positions, each one (head, dim) after another, so the TILE x d keys a score
 *   tile reads are one contiguous run; values [rows, kvh, cap, d]), rows kstride[c] / vstride[c]
 *   floats apart; cap % TILE == 0
 *   shared[i]    positions that every row of decode i's class holds in the same cached blocks:
 *                read from that first row ("row 0" below), which every member reads, so it stays in cache
 *                (shared[i] < len[i]: this step's position is never among them)
 *   out          [n, kvh * g, d]
 *   kpool, vpool [pool_slots, kvh, d]  the paged pool, flat (NULL: the caller stores this step's K/V
 *                there itself); slot[i] is where decode i's new K/V go
 * Row i attends to positions [max(0, len[i] - window), len[i]) (window 0: all of them).
 * scratch holds threads * scratch_stride floats; scratch_stride >= MAX_BLOCK * g * round_up(max len, TILE)
 * (a thread's score rows for a block of decodes, see attend_block).
 * Returns 0; -1 for a shape beyond the limits, -2 for a decode out of bounds (decode_in_bounds:
 * its class, row, length, shared prefix or slot; nothing written in either case), -3 when memory for the work list ran out.
 */
#include <float.h>
#include <stdint.h>
#include "bf16.h"
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "decode_args.h"

/* The model's element type: float32 here; decode_attention_bf16.c includes this file with
 * BATCHGEN_BF16 defined for bfloat16 rows, queries, pools and output (every sum, score and the
 * softmax stay float32: each bf16 element is widened as it is loaded, exactly, and only the output
 * is rounded, to nearest even as torch rounds). Its exported names end in _bf16. */
#ifdef BATCHGEN_BF16
typedef uint16_t elem;
#define LD(x) bf16_widen(x)
#define ST(x) bf16_round(x)
#define EXPORT(name) name##_bf16
#else
typedef float elem;
#define LD(x) (x)
#define ST(x) (x)
#define EXPORT(name) name
#endif

#define TILE 16
#define MAX_G 8
#define MAX_D 256
#define MAX_NT 8
#define MAX_BLOCK 4 /* decodes attended together over a shared prefix (attend_block) */
/* as many as keep their accumulators, m * g * d floats, within 16 512-bit registers */
#define BLOCK_DECODES(g, d) ((g) * (d) <= 64 ? 4 : (g) * (d) <= 128 ? 2 : 1)
/* tiles scored at once for g queries per KV head: about eight accumulator chains in all, each a
 * tile's 16 floats (one 512-bit register); with 256-bit vectors a chain takes two registers of 16,
 * so half as many tiles (an AVX2 build with the counts above ran slower than one tile at a time,
 * one with half of them faster) */
#ifdef __AVX512F__
#define SCORE_TILES(g) ((g) >= 8 ? 1 : (g) >= 4 ? 2 : (g) == 3 ? 3 : (g) == 2 ? 4 : 8)
#else
#define SCORE_TILES(g) ((g) >= 4 ? 1 : (g) >= 2 ? 2 : 4)
#endif

/* scores s[j * stride + l] = scale * q_j . K[:, l] for the nt tiles from l0 (l0 % TILE == 0), j < g, read
 * from kt on, one tile after another (one base pointer: the compiler kept an array of per-tile
 * pointers in memory and reloaded them every multiply-add pass); the last tile may be `width` <
 * TILE positions wide (then nt == 1).
 * Why nt tiles at once: each (query, tile) pair is one chain of dependent multiply-adds, and with
 * one or two queries per KV head a single tile gave the FPU two chains to overlap where it needs
 * about eight; nt * g independent accumulators keep it busy (see SCORE_TILES). */
static inline __attribute__((always_inline)) void score_tiles(const int64_t g, const int64_t d, const int64_t nt,
                                                              const elem *kt, int64_t l0, int64_t width,
                                                              float qs[MAX_G][MAX_D], float *s, int64_t stride) {
  float acc[MAX_NT][MAX_G][TILE];
  for (int64_t t = 0; t < nt; t++)
    for (int64_t j = 0; j < g; j++)
      for (int64_t p = 0; p < TILE; p++) acc[t][j][p] = 0.f;
  for (int64_t x = 0; x < d; x++) {
    for (int64_t t = 0; t < nt; t++) {
      const elem *kr = kt + t * TILE * d + x * TILE;
      for (int64_t j = 0; j < g; j++) {
        const float qx = qs[j][x];
#pragma omp simd
        for (int64_t p = 0; p < width; p++) acc[t][j][p] += qx * LD(kr[p]);
      }
    }
  }
  for (int64_t t = 0; t < nt; t++)
    for (int64_t j = 0; j < g; j++)
      for (int64_t p = 0; p < width; p++) s[j * stride + l0 + t * TILE + p] = acc[t][j][p];
}

/* e^x for the softmax's x = score - row maximum <= 0, in plain arithmetic so that the loop vectorises.
 * Why not expf: without -ffast-math glibc declares no vector variant, and a scalar call per score
 * took a quarter of the kernel's time. x = n ln 2 + r with |r| <= ln 2 / 2 (ln 2 in two parts,
 * the exact product with the high part subtracted first), e^r by its Taylor series to r^7 / 7!
 * (truncation ~5e-9 relative), times 2^n built in the exponent bits: within 1 ulp of e^x over
 * [-87, 0] (tests/engine/test_native.py checks every 97th float there). Below -87 it returns 0, as
 * expf underflows there (to denormals, then 0), so a row whose scores are all -inf gives 0 / 0 =
 * NaN as torch's softmax does; a NaN stays NaN (both comparisons are false for it). */
static inline float exp_nonpositive(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float n = __builtin_rintf(xc * 1.44269504088896341f);
  const float r = __builtin_fmaf(n, -1.42860682030941723e-6f, __builtin_fmaf(n, -6.93145751953125e-1f, xc));
  float p = 1.f / 5040.f;
  p = __builtin_fmaf(p, r, 1.f / 720.f);
  p = __builtin_fmaf(p, r, 1.f / 120.f);
  p = __builtin_fmaf(p, r, 1.f / 24.f);
  p = __builtin_fmaf(p, r, 1.f / 6.f);
  p = __builtin_fmaf(p, r, .5f);
  p = __builtin_fmaf(p, r, 1.f);
  p = __builtin_fmaf(p, r, 1.f);
  union {
    uint32_t i;
    float f;
  } scale = {.i = (uint32_t)((int32_t)n + 127) << 23}; /* n in [-126, 0]: a normal power of two */
  return x < -87.f ? 0.f : p * scale.f;
}

#ifndef BATCHGEN_BF16
/* Exported for the tests only: y[i] = exp_nonpositive(x[i]). */
void batchgen_exp_nonpositive(int64_t count, const float *x, float *y) {
  for (int64_t i = 0; i < count; i++) y[i] = exp_nonpositive(x[i]);
}
#endif

/* rows j < g of s (stride apart), positions start..len-1: scores -> e^(score - row max); inv[j] = 1 / their sum */
static inline __attribute__((always_inline)) void softmax_rows(const int64_t g, const int64_t start, const int64_t len,
                                                               float *s, const int64_t stride, float *inv) {
  for (int64_t j = 0; j < g; j++) {
    float *sj = s + j * stride;
    float top = -FLT_MAX;
#pragma omp simd reduction(max : top)
    for (int64_t l = start; l < len; l++) top = sj[l] > top ? sj[l] : top;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t l = start; l < len; l++) {
      const float e = exp_nonpositive(sj[l] - top);
      sj[l] = e;
      sum += e;
    }
    inv[j] = 1.f / sum;
  }
}

/* one decode's scores over whole tiles [l0, end) of a run of contiguous tiles from `base`: nt at a
 * time, then one at a time (a constant width and count keep the accumulators in registers);
 * returns where it stopped */
static inline __attribute__((always_inline)) int64_t score_run(const int64_t g, const int64_t d, const elem *base,
                                                               int64_t l0, const int64_t end, float qs[MAX_G][MAX_D],
                                                               float *s, const int64_t stride) {
  const int64_t nt = SCORE_TILES(g);
  for (; l0 + nt * TILE <= end; l0 += nt * TILE) score_tiles(g, d, nt, base + l0 * d, l0, TILE, qs, s, stride);
  for (; l0 + TILE <= end; l0 += TILE) score_tiles(g, d, 1, base + l0 * d, l0, TILE, qs, s, stride);
  return l0;
}

/* one decode's scores from the tile holding position `from` to len: whole tiles below `split` (a
 * multiple of TILE) from the class's first row kp, the rest, and the last partial tile, from its own k */
static inline __attribute__((always_inline)) void scores(const int64_t g, const int64_t d, const elem *kp,
                                                         const elem *k, const int64_t from, const int64_t split,
                                                         const int64_t len, float qs[MAX_G][MAX_D], float *s,
                                                         const int64_t stride) {
  int64_t l0 = score_run(g, d, kp, from / TILE * TILE, split, qs, s, stride);
  l0 = score_run(g, d, k, l0, len / TILE * TILE, qs, s, stride);
  if (l0 < len) score_tiles(g, d, 1, k + l0 * d, l0, len - l0, qs, s, stride);
}

/* acc[j] (even positions) and acc2[j] (odd) += s[j][l] * base[l] for l in [l, end): two
 * accumulators, so the multiply-adds form independent chains; returns end */
static inline __attribute__((always_inline)) int64_t value_run(const int64_t g, const int64_t d, const elem *base,
                                                               int64_t l, const int64_t end, const float *s,
                                                               const int64_t stride, float acc[MAX_G][MAX_D],
                                                               float acc2[MAX_G][MAX_D]) {
  for (; l + 1 < end; l += 2) {
    const elem *v0 = base + l * d, *v1 = v0 + d;
    for (int64_t j = 0; j < g; j++) {
      const float p0 = s[j * stride + l], p1 = s[j * stride + l + 1];
#pragma omp simd
      for (int64_t x = 0; x < d; x++) {
        acc[j][x] += p0 * LD(v0[x]);
        acc2[j][x] += p1 * LD(v1[x]);
      }
    }
  }
  if (l < end) {
    const elem *v0 = base + l * d;
    for (int64_t j = 0; j < g; j++) {
      const float p0 = s[j * stride + l];
#pragma omp simd
      for (int64_t x = 0; x < d; x++) acc[j][x] += p0 * LD(v0[x]);
    }
  }
  return end > l ? end : l;
}

/* out[j] = (acc[j] + acc2[j]) * inv[j] */
static inline __attribute__((always_inline)) void finish(const int64_t g, const int64_t d, float acc[MAX_G][MAX_D],
                                                         float acc2[MAX_G][MAX_D], const float *inv, elem *out) {
  for (int64_t j = 0; j < g; j++)
    for (int64_t x = 0; x < d; x++) out[j * d + x] = ST((acc[j][x] + acc2[j][x]) * inv[j]);
}

static inline __attribute__((always_inline)) void attend(const int64_t g, const int64_t d, const int64_t start,
                                                         const int64_t len, const int64_t shared, const elem *q,
                                                         const int64_t qh, const elem *k, const elem *v, const elem *kp,
                                                         const elem *vp, float scale, elem *out, float *s) {
  const int64_t stride = (len + TILE - 1) / TILE * TILE;
  float qs[MAX_G][MAX_D];
  for (int64_t j = 0; j < g; j++)
    for (int64_t x = 0; x < d; x++) qs[j][x] = LD(q[j * qh + x]) * scale;
  const int64_t split = shared / TILE * TILE; /* whole tiles of the prefix (shared < len) */
  scores(g, d, kp, k, start, split, len, qs, s, stride);
  float inv[MAX_G];
  softmax_rows(g, start, len, s, stride, inv);
  float acc[MAX_G][MAX_D], acc2[MAX_G][MAX_D];
  for (int64_t j = 0; j < g; j++)
    for (int64_t x = 0; x < d; x++) acc[j][x] = acc2[j][x] = 0.f;
  /* the shared prefix from the first row, then the own positions */
  const int64_t l = value_run(g, d, vp, start, shared > start ? shared : start, s, stride, acc, acc2);
  value_run(g, d, v, l, len, s, stride, acc, acc2);
  finish(g, d, acc, acc2, inv, out);
}

/* m decodes of one class that hold their first `shared` positions in the same cached blocks,
 * attended together over that prefix: each key and value of it is read once (from the class's
 * first row) for the m * g queries, where one decode at a time reads it m times and does g
 * multiply-adds per float read, too few for the cache to keep the FPU busy. Their own positions
 * then go one decode at a time, as in attend(). k[u], v[u]: decode u's own row; s: scratch for
 * m decodes, decode u's g score rows from s + u * rows. No sliding window (the caller's check). */
static inline __attribute__((always_inline)) void attend_block(
    const int64_t g, const int64_t d, const int64_t m, const int64_t *len, const int64_t shared, const elem *const *q,
    const int64_t qh, const elem *const *k, const elem *const *v, const elem *kp, const elem *vp, float scale,
    elem *const *out, float *s, const int64_t rows) {
  float qs[MAX_BLOCK][MAX_G][MAX_D];
  int64_t stride[MAX_BLOCK];
  for (int64_t u = 0; u < m; u++) {
    stride[u] = (len[u] + TILE - 1) / TILE * TILE;
    for (int64_t j = 0; j < g; j++)
      for (int64_t x = 0; x < d; x++) qs[u][j][x] = LD(q[u][j * qh + x]) * scale;
  }
  const int64_t split = shared / TILE * TILE; /* whole tiles of the prefix: shared < len, so none is a row's last */
  for (int64_t l0 = 0; l0 < split; l0 += TILE) {
    float acc[MAX_BLOCK][MAX_G][TILE];
    for (int64_t u = 0; u < m; u++)
      for (int64_t j = 0; j < g; j++)
        for (int64_t p = 0; p < TILE; p++) acc[u][j][p] = 0.f;
    const elem *kt = kp + l0 * d;
    for (int64_t x = 0; x < d; x++) {
      const elem *kr = kt + x * TILE;
      for (int64_t u = 0; u < m; u++)
        for (int64_t j = 0; j < g; j++) {
          const float qx = qs[u][j][x];
#pragma omp simd
          for (int64_t p = 0; p < TILE; p++) acc[u][j][p] += qx * LD(kr[p]);
        }
    }
    for (int64_t u = 0; u < m; u++)
      for (int64_t j = 0; j < g; j++)
        for (int64_t p = 0; p < TILE; p++) s[u * rows + j * stride[u] + l0 + p] = acc[u][j][p];
  }
  float inv[MAX_BLOCK][MAX_G];
  for (int64_t u = 0; u < m; u++) { /* the rest of each decode's scores, from its own row */
    scores(g, d, k[u], k[u], split, split, len[u], qs[u], s + u * rows, stride[u]);
    softmax_rows(g, 0, len[u], s + u * rows, stride[u], inv[u]);
  }
  float acc[MAX_BLOCK][MAX_G][MAX_D];
  for (int64_t u = 0; u < m; u++)
    for (int64_t j = 0; j < g; j++)
      for (int64_t x = 0; x < d; x++) acc[u][j][x] = 0.f;
  for (int64_t l = 0; l < shared; l++) {
    const elem *vr = vp + l * d;
    for (int64_t u = 0; u < m; u++)
      for (int64_t j = 0; j < g; j++) {
        const float p = s[u * rows + j * stride[u] + l];
#pragma omp simd
        for (int64_t x = 0; x < d; x++) acc[u][j][x] += p * LD(vr[x]);
      }
  }
  for (int64_t u = 0; u < m; u++) { /* own positions: locals, so the sums stay in registers */
    float a[MAX_G][MAX_D], a2[MAX_G][MAX_D];
    for (int64_t j = 0; j < g; j++)
      for (int64_t x = 0; x < d; x++) a[j][x] = acc[u][j][x], a2[j][x] = 0.f;
    value_run(g, d, v[u], shared, len[u], s + u * rows, stride[u], a, a2);
    finish(g, d, a, a2, inv[u], out[u]);
  }
}

/* Specialised for common (g, d), so the accumulators live in registers; any other shape runs generic. */
#define SHAPE(G, D)                                                                   \
  if (g == G && d == D) {                                                             \
    attend(G, D, start, len[i], shared[i], qi, qh, k, v, kp, vp, scale, oi, s);      \
    continue;                                                                         \
  }
#define BLOCK_SHAPE(G, D)                                                                                    \
  if (g == G && d == D) {                                                                                    \
    attend_block(G, D, BLOCK_DECODES(G, D), len + i0, shared[i0], qu, qh, ku, vu, kp, vp, scale, ou, s,       \
                 scratch_stride / MAX_BLOCK);                                                                \
    continue;                                                                                                \
  }

/* The call's arguments, all int64, at the indices of decode_args.h (A_*) in one array. Why one
 * array: the caller fills what holds for the step once and per layer only what changes (the
 * tensors' addresses and strides, the window, the pool), and a ctypes call converting 26 arguments
 * took ~2.1 us against ~0.5 for two. q, knew and vnew are read through their strides (the model's
 * [heads, tokens, d] views, d contiguous), so no per-layer transposed copies; the first n tokens are
 * the decodes. */
#ifndef BATCHGEN_BF16
const char *batchgen_decode_attention_arg_names(void) { return BATCHGEN_DECODE_ARGS(BATCHGEN_NAME); }
#endif

/* Whether decode i may be attended: its class and row inside the class tensors, its length inside
 * its row, a row as large as its class's stride says, its shared prefix short of its length, its
 * slot inside the pool. Why checked here too: every write goes through these raw indices. */
static int decode_in_bounds(const int64_t *a, int64_t i) {
  const int64_t *cls = (const int64_t *)a[A_CLS], *row = (const int64_t *)a[A_ROW], *cap = (const int64_t *)a[A_CAP];
  const int64_t *len = (const int64_t *)a[A_LEN], *shared = (const int64_t *)a[A_SHARED];
  const int64_t *rows = (const int64_t *)a[A_ROWS], *slot = (const int64_t *)a[A_SLOT];
  const int64_t *kstride = (const int64_t *)a[A_KSTRIDE], *vstride = (const int64_t *)a[A_VSTRIDE];
  const int64_t c = cls[i], row_floats = a[A_KVH] * cap[i] * a[A_D];
  if (c < 0 || c >= a[A_CLASSES] || row[i] < 0 || row[i] >= rows[c]) return 0;
  if (cap[i] < TILE || cap[i] % TILE || kstride[c] < row_floats || vstride[c] < row_floats) return 0;
  if (len[i] < 1 || len[i] > cap[i] || shared[i] < 0 || shared[i] >= len[i]) return 0;
  return !a[A_KPOOL] || (slot[i] >= 0 && slot[i] < a[A_POOL_SLOTS]);
}

int64_t EXPORT(batchgen_decode_attention)(const int64_t *a, float scale) {
  const int64_t n = a[A_N], kvh = a[A_KVH], g = a[A_G], d = a[A_D], threads = a[A_THREADS];
  const elem *q = (const elem *)a[A_Q], *knew = (const elem *)a[A_KNEW], *vnew = (const elem *)a[A_VNEW];
  const int64_t qh = a[A_Q_HEAD], qt = a[A_Q_TOKEN];
  const int64_t khs = a[A_K_HEAD], kts = a[A_K_TOKEN], vhs = a[A_V_HEAD], vts = a[A_V_TOKEN];
  const int64_t *kbase = (const int64_t *)a[A_KBASE], *vbase = (const int64_t *)a[A_VBASE];
  const int64_t *kstride = (const int64_t *)a[A_KSTRIDE], *vstride = (const int64_t *)a[A_VSTRIDE];
  const int64_t *cls = (const int64_t *)a[A_CLS], *row = (const int64_t *)a[A_ROW], *cap = (const int64_t *)a[A_CAP];
  const int64_t *len = (const int64_t *)a[A_LEN], *shared = (const int64_t *)a[A_SHARED];
  elem *kpool = (elem *)a[A_KPOOL], *vpool = (elem *)a[A_VPOOL];
  const int64_t *slot = (const int64_t *)a[A_SLOT];
  const int64_t window = a[A_WINDOW], scratch_stride = a[A_SCRATCH_STRIDE];
  elem *out = (elem *)a[A_OUT];
  float *scratch = (float *)a[A_SCRATCH];
  if (g < 1 || g > MAX_G || d < 1 || d > MAX_D || kvh < 1 || n < 0) return -1;
  for (int64_t i = 0; i < n; i++)
    if (!decode_in_bounds(a, i)) return -2;
  /* work items: (block, KV head); a block is BLOCK_DECODES consecutive decodes of one class with a
   * shared prefix of at least a tile (attend_block), or else one decode */
  const int64_t bm = window > 0 ? 1 : BLOCK_DECODES(g, d);
  int64_t *first = malloc((n + 1) * sizeof(int64_t));
  if (!first) return -3;
  int64_t nb = 0;
  for (int64_t i = 0; i < n;) {
    int64_t m = 1;
    if (bm > 1 && shared[i] >= TILE)
      while (m < bm && i + m < n && cls[i + m] == cls[i] && shared[i + m] == shared[i]) m++;
    first[nb++] = i;
    i += m == bm ? m : 1;
  }
  first[nb] = n;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
  for (int64_t item = 0; item < nb * kvh; item++) {
    const int64_t b = item / kvh, h = item % kvh, i0 = first[b], m = first[b + 1] - i0, k0 = cls[i0], c = cap[i0];
    elem *kr = (elem *)kbase[k0], *vr = (elem *)vbase[k0]; /* the class's row 0 */
    const elem *kp = kr + h * d * c, *vp = vr + h * c * d;
    const elem *qu[MAX_BLOCK], *ku[MAX_BLOCK], *vu[MAX_BLOCK];
    elem *ou[MAX_BLOCK];
    for (int64_t u = 0; u < m; u++) { /* this step's K/V into the rows (and the pool) */
      const int64_t i = i0 + u, last = len[i] - 1;
      elem *k = kr + row[i] * kstride[k0] + h * d * c, *v = vr + row[i] * vstride[k0] + h * c * d;
      const elem *kn = knew + i * kts + h * khs, *vn = vnew + i * vts + h * vhs;
      for (int64_t x = 0; x < d; x++) k[(last - last % TILE) * d + x * TILE + last % TILE] = kn[x];
      memcpy(v + last * d, vn, d * sizeof(elem));
      if (kpool) {
        memcpy(kpool + (slot[i] * kvh + h) * d, kn, d * sizeof(elem));
        memcpy(vpool + (slot[i] * kvh + h) * d, vn, d * sizeof(elem));
      }
      qu[u] = q + i * qt + h * g * qh, ku[u] = k, vu[u] = v, ou[u] = out + (i * kvh + h) * g * d;
    }
    float *s = scratch + omp_get_thread_num() * scratch_stride;
    if (m > 1) {
      BLOCK_SHAPE(1, 64) BLOCK_SHAPE(2, 32) BLOCK_SHAPE(2, 64) BLOCK_SHAPE(4, 32) BLOCK_SHAPE(1, 128)
      attend_block(g, d, m, len + i0, shared[i0], qu, qh, ku, vu, kp, vp, scale, ou, s, scratch_stride / MAX_BLOCK);
      continue;
    }
    const int64_t start = window > 0 && len[i0] > window ? len[i0] - window : 0;
    const elem *k = ku[0], *v = vu[0], *qi = qu[0];
    elem *oi = ou[0];
    if (!shared[i0]) kp = k, vp = v;
    const int64_t i = i0;
    SHAPE(1, 64) SHAPE(1, 128) SHAPE(2, 32) SHAPE(2, 64) SHAPE(2, 128) SHAPE(3, 64) SHAPE(3, 128)
    SHAPE(4, 32) SHAPE(4, 64) SHAPE(4, 128) SHAPE(6, 64) SHAPE(6, 128) SHAPE(8, 64) SHAPE(8, 128)
    attend(g, d, start, len[i], shared[i], qi, qh, k, v, kp, vp, scale, oi, s);
  }
  free(first);
  return 0;
}

/* One decode row's first `length` positions of one layer, copied out of the paged pool:
 *   kpool, vpool [pool_blocks, block_size, kvh, d]   the layer's pool (float32, contiguous)
 *   blocks       [nblocks]                           the sequence's blocks, in position order
 *   row_k        [kvh, cap / TILE, d, TILE]          the row's keys in the kernel's tiles; the
 *                                                   last tile's positions from `length` on are zeroed
 *   row_v        [kvh, cap, d]                       the row's values
 * Why in C: torch did it as a gather of the blocks, a pad, and a transposing copy into the tiles
 * (three passes, the last strided); a row's fill is one pass here, tile by tile, and the writes to
 * a tile are contiguous. Returns 0, or -1 (nothing written) for a length or block out of range. */
int64_t EXPORT(batchgen_fill_row)(const elem *kpool, const elem *vpool, int64_t pool_blocks, int64_t block_size,
                                  int64_t kvh, int64_t d, const int64_t *blocks, int64_t nblocks, int64_t length,
                                  elem *row_k, elem *row_v, int64_t cap, int64_t threads) {
  if (length < 0 || length > cap || cap % TILE || block_size < 1 || length > nblocks * block_size || d < 1 ||
      d > MAX_D)
    return -1;
  for (int64_t b = 0; b < (length + block_size - 1) / block_size; b++)
    if (blocks[b] < 0 || blocks[b] >= pool_blocks) return -1;
  const int64_t tiles = (length + TILE - 1) / TILE, token = kvh * d;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t item = 0; item < kvh * tiles; item++) {
    const int64_t h = item / tiles, t = item % tiles, p0 = t * TILE;
    const int64_t width = length - p0 < TILE ? length - p0 : TILE;
    const elem *src[TILE];
    for (int64_t j = 0; j < width; j++) {
      const int64_t p = p0 + j;
      const int64_t at = (blocks[p / block_size] * block_size + p % block_size) * token + h * d;
      src[j] = kpool + at;
      memcpy(row_v + (h * cap + p) * d, vpool + at, d * sizeof(elem));
    }
    elem *dst = row_k + h * cap * d + p0 * d; /* the tile: d runs of TILE positions */
    for (int64_t x = 0; x < d; x++) {
      for (int64_t j = 0; j < width; j++) dst[x * TILE + j] = src[j][x];
      for (int64_t j = width; j < TILE; j++) dst[x * TILE + j] = 0;
    }
  }
  return 0;
}
