/* rows_attention.c against a float64 model of attention, over random shapes, lengths
 * (0 included), strided cache views, magnitudes and element types (float32, bf16: the
 * model reads the bf16 values); built by build_and_test.sh with each
 * variant's flags (and ATTENTION_FLAGS), natively or under qemu-aarch64.
 *
 *   test_rows_attention NAME [SEED]   prints "rows_attention NAME: pass (N cases ...)" */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rows_attention.h"

static uint64_t rng_state;
static uint64_t next_u64(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ULL;
}
static int below(int n) { return (int)(next_u64() % (uint64_t)n); }
/* x rounded to bf16 (to nearest even; inputs are finite), as float and as its bits. */
static uint16_t bf16_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static float bf16_round(float x) {
  uint32_t b = (uint32_t)bf16_bits(x) << 16;
  float f;
  memcpy(&f, &b, sizeof f);
  return f;
}
/* n floats as bf16 bits, each float rounded to its bf16 value in place. */
static uint16_t *to_bf16(float *x, size_t n) {
  uint16_t *out = malloc(n * sizeof(uint16_t));
  for (size_t i = 0; i < n; i++) { out[i] = bf16_bits(x[i]); x[i] = bf16_round(x[i]); }
  return out;
}
static float uniform(float m) { return m * ((float)(next_u64() >> 40) / (float)(1 << 24) * 2.0f - 1.0f); }

int main(int argc, char **argv) {
  const char *name = argc > 1 ? argv[1] : "?";
  rng_state = argc > 2 ? strtoull(argv[2], NULL, 0) : 20240501;
  static const int dims[] = {8, 16, 24, 64, 128};
  static const float magnitudes[] = {0.1f, 1.0f, 6.0f};
  int cases = 300;
  for (int c = 0; c < cases; c++) {
    int S = 1 + below(8), G = 1 + below(4), R = 1 + below(8), D = dims[below(5)];
    int C = 1 + below(200), spare = below(3);
    float mag = magnitudes[below(3)];
    /* The cache [S + spare][G][C + 3][D]; the call reads rows spare.. as a view. */
    int64_t ks2 = D, ks1 = (int64_t)(C + 3) * D, ks0 = (int64_t)G * ks1;
    size_t cache = (size_t)(S + spare) * (size_t)ks0;
    float *k = malloc(cache * sizeof(float)), *v = malloc(cache * sizeof(float));
    float *q = malloc((size_t)S * G * R * D * sizeof(float));
    float *out = malloc((size_t)S * G * R * D * sizeof(float));
    float *scores = malloc((size_t)R * C * sizeof(float));
    int64_t *lengths = malloc((size_t)S * sizeof(int64_t));
    for (size_t i = 0; i < cache; i++) { k[i] = uniform(mag); v[i] = uniform(1.0f); }
    for (int i = 0; i < S * G * R * D; i++) q[i] = uniform(mag);
    for (int s = 0; s < S; s++) lengths[s] = below(4) == 0 ? 0 : 1 + below(C);
    float scale = 1.0f / sqrtf((float)D);
    aici_attention_args a = {q, {(int64_t)G * R * D, (int64_t)R * D, D},
                             k + spare * ks0, {ks0, ks1, ks2}, v + spare * ks0, {ks0, ks1, ks2},
                             lengths, G, R, D, scale, out, AICI_ELEM_F32};
    uint16_t *qb = NULL, *kb = NULL, *vb = NULL;
    if (c % 2) { /* bf16 inputs: the float copies rounded to them, which the model reads */
      qb = to_bf16(q, (size_t)S * G * R * D);
      kb = to_bf16(k, cache);
      vb = to_bf16(v, cache);
      a.q = qb, a.k = kb + spare * ks0, a.v = vb + spare * ks0, a.elem = AICI_ELEM_BF16;
    }
    /* Two ranges of items, as two threads would run them. */
    int64_t items = (int64_t)S * G, half = items / 2;
    aici_rows_attention(&a, 0, half, scores);
    aici_rows_attention(&a, half, items, scores);
    for (int s = 0; s < S; s++)
      for (int g = 0; g < G; g++)
        for (int r = 0; r < R; r++) {
          const float *o = out + (((int64_t)s * G + g) * R + r) * D;
          const float *qr = q + (((int64_t)s * G + g) * R + r) * D;
          const float *kk = k + (s + spare) * ks0 + g * ks1, *vv = v + (s + spare) * ks0 + g * ks1;
          int64_t L = lengths[s];
          double *p = malloc((size_t)(L ? L : 1) * sizeof(double)), top = -INFINITY, total = 0;
          for (int64_t j = 0; j < L; j++) {
            double dot = 0;
            for (int d = 0; d < D; d++) dot += (double)qr[d] * kk[j * ks2 + d];
            p[j] = dot * scale;
            if (p[j] > top) top = p[j];
          }
          for (int64_t j = 0; j < L; j++) { p[j] = exp(p[j] - top); total += p[j]; }
          for (int d = 0; d < D; d++) {
            double want = 0;
            for (int64_t j = 0; j < L; j++) want += p[j] * vv[j * ks2 + d];
            want = L ? want / total : 0.0;
            if (fabs(o[d] - want) > 2e-5 + 1e-4 * fabs(want) || (L == 0 && o[d] != 0.0f)) {
              printf("rows_attention %s: FAILED case %d (%s S %d G %d R %d D %d L %lld): %g, want %g\n",
                     name, c, c % 2 ? "bf16" : "float32", S, G, R, D, (long long)L, o[d], want);
              return 1;
            }
          }
          free(p);
        }
    free(k); free(v); free(q); free(out); free(scores); free(lengths);
    free(qb); free(kb); free(vb);
  }
  printf("rows_attention %s: pass (%d cases, float32 and bf16, against a float64 model)\n",
         name, cases);
  return 0;
}
