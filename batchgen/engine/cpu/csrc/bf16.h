/* bfloat16 <-> float32 for the kernels' bf16 twins (decode attention, skinny linear, row argmax):
 * widening is exact (the bf16 bits are a float32's top half); rounding is to nearest even, as
 * torch rounds, and a NaN stays a (quiet) NaN. One copy, so every kernel rounds alike. */
#ifndef BATCHGEN_BF16_H
#define BATCHGEN_BF16_H
#include <stdint.h>

static inline __attribute__((always_inline)) float bf16_widen(const uint16_t x) {
  union {
    uint32_t i;
    float f;
  } u = {.i = (uint32_t)x << 16};
  return u.f;
}

static inline __attribute__((always_inline)) uint16_t bf16_round(const float f) {
  union {
    float f;
    uint32_t i;
  } u = {.f = f};
  if (f != f) return (uint16_t)((u.i >> 16) | 0x40);
  return (uint16_t)((u.i + 0x7fffu + ((u.i >> 16) & 1u)) >> 16);
}
#endif
