/* The core's own arithmetic limit: float32 FMA (vfmadd231ps) against bf16 dot products (vdpbf16ps),
 * both on 512-bit registers, 16 independent accumulators (enough to hide either one's latency), no
 * memory traffic. Prints GFLOP/s of one thread for each, interleaved over rounds (best of each).
 * Why: the ratio of these two is the most a bf16 matmul can gain over a float32 one on this core,
 * whatever library runs it; benchmarks/peak.py builds and runs this (`--limit`).
 * FLOPs: an FMA of 16 floats is 32; a vdpbf16ps of 32 bf16 pairs into 16 floats is 64.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ACC 16
#define ITERS 20000000L

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static double fma_gflops(float seed) {
  __m512 acc[ACC], a = _mm512_set1_ps(seed), b = _mm512_set1_ps(0.999f);
  for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_ps((float)i);
  double t = now();
  for (long it = 0; it < ITERS; it++)
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
  t = now() - t;
  float sink = 0;
  for (int i = 0; i < ACC; i++) sink += _mm512_reduce_add_ps(acc[i]);
  if (sink == 1.2345f) printf("#");
  return ITERS * ACC * 32.0 / t / 1e9;
}

static double dpbf16_gflops(float seed) {
  __m512 acc[ACC];
  __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(seed), _mm512_set1_ps(seed));
  __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0.999f), _mm512_set1_ps(0.999f));
  for (int i = 0; i < ACC; i++) acc[i] = _mm512_set1_ps((float)i);
  double t = now();
  for (long it = 0; it < ITERS; it++)
    for (int i = 0; i < ACC; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  t = now() - t;
  float sink = 0;
  for (int i = 0; i < ACC; i++) sink += _mm512_reduce_add_ps(acc[i]);
  if (sink == 1.2345f) printf("#");
  return ITERS * ACC * 64.0 / t / 1e9;
}

int main(void) {
  double f32 = 0, bf16 = 0;
  for (int round = 0; round < 5; round++) {
    double x = fma_gflops(1e-3f + round), y = dpbf16_gflops(1e-3f + round);
    f32 = x > f32 ? x : f32;
    bf16 = y > bf16 ? y : bf16;
  }
  printf("{\"fma_f32_gflops_1thread\": %.1f, \"dpbf16_gflops_1thread\": %.1f, \"ratio\": %.2f}\n", f32, bf16, bf16 / f32);
  return 0;
}
