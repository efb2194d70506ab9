/* The portable parts: the activation quantiser every variant shares, and the scalar
 * reference of the tile products (int_dot.h), plain C11 for any CPU.
 *
 * The reference decodes the tiled layout byte by byte and performs, per output, the
 * float operations int_dot.h lists, in its order, with fmaf: the vector variants do the
 * same per lane, so they must agree with it bit for bit. Build it with -std=c11 (or
 * -ffp-contract=off): no multiply-add may be fused beyond the explicit fmaf calls.
 *
 * Cost: one multiply per weight, no vectors; a reference and a fallback, not a kernel.
 */
#include "int_dot.h"

#include <math.h>
#include <string.h>

/* Nearest, ties away from zero, clamped to -127..127: the torch operator's quantise,
 * float32 operation for operation (inputs finite).
 *
 * Written without branches on the data, so that the compiler vectorises it (SSE2 at
 * least): with a branch on each value's sign it ran ~6 ns an element (a mispredict every
 * other value), a tenth of a decode step on AVX2. The same operations either way:
 * - the absolute maximum is taken on the bit patterns: for finite floats with the sign
 *   cleared, integer order is float order, and a max is exact in any order;
 * - t - 0.5f for t < 0 is t + (-0.5f), one rounding alike; t = -0.0 gives -0.5f and
 *   truncates to 0, as t + 0.5f does. */
static void quantise_group(const float v[AICI_GROUP], int8_t *x8, float *xd, int32_t *s) {
  int32_t top = 0; /* the largest |v| as its bits (sign cleared: a non-negative int32) */
  for (int i = 0; i < AICI_GROUP; i++) {
    int32_t b;
    memcpy(&b, &v[i], 4);
    b &= 0x7fffffff;
    top = b > top ? b : top;
  }
  float amax;
  memcpy(&amax, &top, 4);
  float d = amax / 127.0f;
  float inv = d != 0.0f ? 1.0f / d : 0.0f;
  /* 1 / d overflows where amax < ~3.7e-37 (d < 2^-128): v inf (NaN for v = 0) would then
   * be converted to int, which is undefined (the torch operator on x86 gets INT_MIN, so
   * -127 for every element of such a group). Divide there instead. */
  float t[AICI_GROUP];
  if (isinf(inv)) {
    for (int i = 0; i < AICI_GROUP; i++) t[i] = v[i] / d;
  } else {
    for (int i = 0; i < AICI_GROUP; i++) t[i] = v[i] * inv;
  }
  int32_t sum = 0;
  for (int i = 0; i < AICI_GROUP; i++) {
    int c = (int)(t[i] + copysignf(0.5f, t[i]));
    c = c > 127 ? 127 : c;
    c = c < -127 ? -127 : c;
    x8[i] = (int8_t)c;
    sum += c;
  }
  *xd = d;
  *s = sum;
}

void aici_quantise_f32(const float *x, int64_t rows, int64_t k, int8_t *x8, float *xd,
                       int32_t *s) {
  for (int64_t at = 0; at < rows * (k / AICI_GROUP); at++)
    quantise_group(x + at * AICI_GROUP, x8 + at * AICI_GROUP, xd + at, s + at);
}

void aici_quantise_bf16(const uint16_t *x, int64_t rows, int64_t k, int8_t *x8, float *xd,
                        int32_t *s) {
  float v[AICI_GROUP];
  for (int64_t at = 0; at < rows * (k / AICI_GROUP); at++) {
    for (int i = 0; i < AICI_GROUP; i++) {
      uint32_t bits = (uint32_t)x[at * AICI_GROUP + i] << 16;
      memcpy(&v[i], &bits, 4);
    }
    quantise_group(v, x8 + at * AICI_GROUP, xd + at, s + at);
  }
}

/* IEEE half to float, exactly (subnormals normalised; inf and NaN kept). */
static float half(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (e == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {
    uint32_t ex = 113;
    while (!(man & 0x400u)) {
      man <<= 1;
      ex--;
    }
    bits = sign | (ex << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

void aici_int4_tiles_generic(const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                             const aici_acts *acts, int64_t n, int64_t tile_begin,
                             int64_t tile_end, float *out) {
  int64_t k = acts->k, groups = k / AICI_GROUP;
  for (int64_t t = tile_begin; t < tile_end; t++) {
    for (int64_t a = 0; a < acts->rows; a++) {
      for (int r = 0; r < AICI_TILE; r++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
          const uint8_t *block = codes + (t * groups + g) * (AICI_TILE * AICI_GROUP / 2);
          const int8_t *x = acts->x8 + a * k + g * AICI_GROUP;
          int32_t dot = 0;
          for (int j = 0; j < 4; j++) {
            for (int i = 0; i < 4; i++) {
              uint8_t b = block[j * 64 + 4 * r + i];
              dot += (b & 0x0f) * x[8 * j + i] + (b >> 4) * x[8 * j + 4 + i];
            }
          }
          int64_t at = a * groups + g, scale = (t * groups + g) * AICI_TILE + r;
          float xs = acts->xd[at];
          if (m) {
            acc = fmaf((float)dot, half(d[scale]) * xs, acc);
            acc = fmaf(half(m[scale]), xs * (float)acts->s[at], acc);
          } else {
            acc = fmaf((float)(dot - 8 * acts->s[at]), half(d[scale]) * xs, acc);
          }
        }
        out[a * n + t * AICI_TILE + r] = acc;
      }
    }
  }
}

void aici_int8_tiles_generic(const uint8_t *codes, const float *scale,
                             const aici_acts *acts, int64_t n, int64_t tile_begin,
                             int64_t tile_end, float *out) {
  int64_t k = acts->k, groups = k / AICI_GROUP;
  for (int64_t t = tile_begin; t < tile_end; t++) {
    for (int64_t a = 0; a < acts->rows; a++) {
      for (int r = 0; r < AICI_TILE; r++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
          const uint8_t *block = codes + (t * groups + g) * (AICI_TILE * AICI_GROUP);
          const int8_t *x = acts->x8 + a * k + g * AICI_GROUP;
          int32_t dot = 0;
          for (int j = 0; j < 8; j++)
            for (int i = 0; i < 4; i++) dot += block[j * 64 + 4 * r + i] * x[4 * j + i];
          int64_t at = a * groups + g;
          acc = fmaf((float)(dot - 128 * acts->s[at]), acts->xd[at], acc);
        }
        out[a * n + t * AICI_TILE + r] = acc * scale[t * AICI_TILE + r];
      }
    }
  }
}
