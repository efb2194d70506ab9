/* Checks every variant compiled in against the generic one, and the generic one against
 * a float64 model built here from the raw (untiled) codes; exits 1 at the first
 * mismatch, naming the variant, case and element. build_and_test.sh builds it:
 *   cc -std=c11 test_int_dot.c generic.c [variant.c with its flags ...] -DAICI_TEST_<V>
 * with AICI_TEST_AVX512_VNNI, _AVX_VNNI, _AVX2, _NEON_DOT, _NEON naming those linked in.
 * Usage: test_int_dot [seed]. One line per variant on success.
 *
 * The bar:
 *   - variants equal the generic outputs bit for bit: the integer sums are exact and
 *     every variant does the same float32 operations per output in the same order
 *     (int_dot.h), so nothing but a wrong sum, layout or order can tell them apart;
 *   - the generic outputs equal the float64 model to float32 rounding: a chain of 2 G
 *     fused steps each rounding once, with one rounded product a step, is off by at most
 *     (2 G + 1) 2^-24 sum |terms| to first order (checked as (2 G + 4), for the higher
 *     orders and int8's final scale), relative to the sum of the terms' magnitudes since
 *     outputs can cancel to near zero; plus, where values are subnormal, 2^-150 a
 *     rounding (times |dot| < 2^16 for a rounded product);
 *   - the quantiser: xd = amax / 127 in float32, |x8| <= 127, s = sum x8, and x8 within
 *     0.5 (plus float32 rounding of v / xd) of v / xd clamped; exact ties away from
 *     zero; bf16 inputs equal their float32 values.
 * Cases: shapes with k = 32 .. 512, n = 16 .. 64, 1 .. 13 activation rows (several
 * passes of AICI_MAX_ROWS and a remainder); codes random, all 0, all 15 / 255, mixed
 * extremes; activations random, all zero, all +-amax (x8 = +-127: with codes 255 the
 * pairs a saturating vpmaddubsw would clip, with codes 0 the w = -128 of a sign trick),
 * subnormal-small groups; scales zero, subnormal, small, large; bf16 inputs; symmetric
 * and asymmetric int4; outputs over split tile ranges, and nothing outside a range
 * written.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "int_dot.h"

typedef struct {
  const char *name;
  aici_int4_tiles_fn *int4;
  aici_int8_tiles_fn *int8;
} variant;

static const variant variants[] = {
    {"generic", aici_int4_tiles_generic, aici_int8_tiles_generic},
#ifdef AICI_TEST_AVX512_VNNI
    {"avx512_vnni", aici_int4_tiles_avx512_vnni, aici_int8_tiles_avx512_vnni},
#endif
#ifdef AICI_TEST_AVX_VNNI
    {"avx_vnni", aici_int4_tiles_avx_vnni, aici_int8_tiles_avx_vnni},
#endif
#ifdef AICI_TEST_AVX2
    {"avx2", aici_int4_tiles_avx2, aici_int8_tiles_avx2},
#endif
#ifdef AICI_TEST_NEON_DOT
    {"neon_dot", aici_int4_tiles_neon_dot, aici_int8_tiles_neon_dot},
#endif
#ifdef AICI_TEST_NEON
    {"neon", aici_int4_tiles_neon, aici_int8_tiles_neon},
#endif
};
enum { VARIANTS = sizeof(variants) / sizeof(variants[0]) };

/* ------------------------------------------------------------------ random numbers */
static uint64_t rng_state;
static uint64_t next(void) { /* splitmix64 */
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static int below(int n) { return (int)(next() % (uint64_t)n); }
static double unit(void) { return (double)(next() >> 11) / 9007199254740992.0; }
static float f32(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* float16 bits to double, independently of generic.c's conversion. */
static double half(uint16_t h) {
  int e = (h >> 10) & 31, man = h & 1023;
  double v = e ? ldexp(1024 + man, e - 25) : ldexp(man, -24);
  return h & 0x8000 ? -v : v;
}

enum { SC_NORMAL, SC_ZERO, SC_TINY, SC_LARGE, SC_MIXED, SC_KINDS };
static uint16_t random_half(int kind) {
  if (kind == SC_MIXED) kind = below(SC_MIXED);
  uint16_t sign = (uint16_t)(below(2) << 15);
  switch (kind) {
    case SC_ZERO: return sign;
    case SC_TINY: /* subnormal, or the smallest normals */
      return (uint16_t)(sign | (below(2) ? 1 + below(1023) : (1 << 10) | below(1024)));
    case SC_LARGE: return (uint16_t)(sign | (25 + below(6)) << 10 | below(1024)); /* to 65504 */
    default: return (uint16_t)(sign | (5 + below(12)) << 10 | below(1024)); /* 2^-10 .. 2^1 */
  }
}
static float random_scale(int kind) {
  if (kind == SC_MIXED) kind = below(SC_MIXED);
  float sign = below(2) ? -1.0f : 1.0f;
  switch (kind) {
    case SC_ZERO: return 0.0f * sign;
    case SC_TINY: return sign * (below(2) ? f32(1 + below(1 << 23)) : 1e-38f);
    case SC_LARGE: return sign * (float)pow(10.0, 20 + 4 * unit());
    default: return sign * (float)pow(10.0, -3 + 3 * unit());
  }
}

/* ------------------------------------------------------------------ a case */
enum { CODES_RANDOM, CODES_MIN, CODES_MAX, CODES_EXTREMES, CODES_KINDS };
enum { X_RANDOM, X_ZERO, X_AMAX_SAME, X_AMAX_SIGNS, X_TINY, X_MIXED, X_KINDS };

typedef struct {
  int64_t rows, n, k;
  int codes, x, scales, symmetric, bf16;
} spec;

static void fail(const char *what, const char *variant_name, int which, const spec *c,
                 const char *form, int64_t a, int64_t o, double got, double want, double tol) {
  fprintf(stderr,
          "FAIL %s %s (case %d: %s rows=%lld n=%lld k=%lld codes=%d x=%d scales=%d bf16=%d)"
          " at row %lld, output %lld: got %.9g (0x%08x), want %.9g (tolerance %.3g)\n",
          what, variant_name, which, form, (long long)c->rows, (long long)c->n,
          (long long)c->k, c->codes, c->x, c->scales, c->bf16, (long long)a, (long long)o,
          got, bits((float)got), want, tol);
  exit(1);
}

static void *grab(size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(2);
  }
  return p;
}

/* The activations of a case: x [rows][k] (bf16 where asked: xb holds the bits). */
static void make_x(const spec *c, float *x, uint16_t *xb) {
  for (int64_t g = 0; g < c->rows * c->k / AICI_GROUP; g++) {
    int kind = c->x == X_MIXED ? below(X_MIXED) : c->x;
    /* tiny: 1e-41 .. 1e-35, both sides of amax = 127 2^-128, where 1 / xd overflows */
    double amp = pow(10.0, kind == X_TINY ? -41 + 6 * unit() : -3 + 7 * unit());
    float sign = below(2) ? -1.0f : 1.0f;
    for (int i = 0; i < AICI_GROUP; i++) {
      float *v = &x[g * AICI_GROUP + i];
      switch (kind) {
        case X_ZERO: *v = 0.0f; break;
        case X_AMAX_SAME: *v = sign * (float)amp; break;
        case X_AMAX_SIGNS: *v = (below(2) ? -1.0f : 1.0f) * (float)amp; break;
        default: *v = (float)(amp * (2 * unit() - 1)); break;
      }
      if (c->bf16) { /* round to nearest even, as torch does */
        uint32_t b = bits(*v);
        b += 0x7fff + ((b >> 16) & 1);
        xb[g * AICI_GROUP + i] = (uint16_t)(b >> 16);
        *v = f32(b & 0xffff0000u);
      }
    }
  }
}

#ifdef AICI_TEST_X86_QUANTISE
/* The AVX2 quantiser gives the generic one's x8, xd and s (already in x8, xd, s) bit for
 * bit, from float32 and from bf16 inputs alike. */
static void check_same_quantiser(const spec *c, const float *x, const uint16_t *xb,
                                 const int8_t *x8, const float *xd, const int32_t *s,
                                 int which) {
  int64_t groups = c->rows * c->k / AICI_GROUP;
  int8_t *y8 = grab((size_t)(c->rows * c->k));
  float *yd = grab(sizeof(float) * (size_t)groups);
  int32_t *ys = grab(sizeof(int32_t) * (size_t)groups);
  if (c->bf16) aici_quantise_bf16_avx2(xb, c->rows, c->k, y8, yd, ys);
  else aici_quantise_f32_avx2(x, c->rows, c->k, y8, yd, ys);
  for (int64_t g = 0; g < groups; g++) {
    if (bits(yd[g]) != bits(xd[g]))
      fail("quantise xd", "x86_quantise", which, c, "", g, 0, yd[g], xd[g], 0);
    if (ys[g] != s[g]) fail("quantise s", "x86_quantise", which, c, "", g, 0, ys[g], s[g], 0);
    for (int i = 0; i < AICI_GROUP; i++)
      if (y8[g * AICI_GROUP + i] != x8[g * AICI_GROUP + i])
        fail("quantise x8", "x86_quantise", which, c, "", g, i, y8[g * AICI_GROUP + i],
             x8[g * AICI_GROUP + i], 0);
  }
  free(y8), free(yd), free(ys);
}
#endif

static void check_quantiser(const spec *c, const float *x, const uint16_t *xb, int8_t *x8,
                            float *xd, int32_t *s, int which) {
  int64_t groups = c->rows * c->k / AICI_GROUP;
  if (c->bf16) {
    int8_t *y8 = grab((size_t)(c->rows * c->k));
    float *yd = grab(sizeof(float) * (size_t)groups);
    int32_t *ys = grab(sizeof(int32_t) * (size_t)groups);
    aici_quantise_f32(x, c->rows, c->k, y8, yd, ys);
    aici_quantise_bf16(xb, c->rows, c->k, x8, xd, s);
    if (memcmp(y8, x8, (size_t)(c->rows * c->k)) ||
        memcmp(yd, xd, sizeof(float) * (size_t)groups) ||
        memcmp(ys, s, sizeof(int32_t) * (size_t)groups))
      fail("quantise_bf16", "generic", which, c, "bf16 vs float32", 0, 0, 0, 0, 0);
    free(y8), free(yd), free(ys);
  } else {
    aici_quantise_f32(x, c->rows, c->k, x8, xd, s);
  }
#ifdef AICI_TEST_X86_QUANTISE
  check_same_quantiser(c, x, xb, x8, xd, s, which);
#endif
  for (int64_t g = 0; g < groups; g++) {
    float amax = 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < AICI_GROUP; i++) amax = fmaxf(amax, fabsf(x[g * AICI_GROUP + i]));
    if (bits(xd[g]) != bits(amax / 127.0f))
      fail("quantise xd", "generic", which, c, "", g, 0, xd[g], amax / 127.0f, 0);
    for (int i = 0; i < AICI_GROUP; i++) {
      int q = x8[g * AICI_GROUP + i];
      double want = xd[g] ? (double)x[g * AICI_GROUP + i] / xd[g] : 0.0;
      want = want > 127 ? 127 : (want < -127 ? -127 : want);
      if (q < -127 || q > 127 || fabs(q - want) > 0.5 + 1e-4)
        fail("quantise x8", "generic", which, c, "", g, i, q, want, 0.5);
      sum += q;
    }
    if (sum != s[g]) fail("quantise s", "generic", which, c, "", g, 0, s[g], sum, 0);
  }
}

/* Runs v over [0, tiles) as 1..3 ranges in a random order, into out (prefilled with a
 * NaN that no product gives), then checks that one call on a middle range writes it
 * alone. */
static const uint32_t UNWRITTEN = 0x7fc0deadu;
static void fill(float *out, int64_t count) {
  for (int64_t i = 0; i < count; i++) out[i] = f32(UNWRITTEN);
}
static void run_split(const variant *v, int int4, const uint8_t *codes, const uint16_t *d,
                      const uint16_t *m, const float *scale, const aici_acts *acts,
                      const spec *c, float *out, int which) {
  int64_t tiles = c->n / AICI_TILE, cut1 = below((int)tiles + 1), cut2 = below((int)tiles + 1);
  if (cut1 > cut2) { int64_t t = cut1; cut1 = cut2; cut2 = t; }
  int64_t ranges[3][2] = {{0, cut1}, {cut1, cut2}, {cut2, tiles}};
  int first = below(3);
  fill(out, c->rows * c->n);
  for (int i = 0; i < 3; i++) {
    int64_t *r = ranges[(first + i) % 3];
    if (int4) v->int4(codes, d, m, acts, c->n, r[0], r[1], out);
    else v->int8(codes, scale, acts, c->n, r[0], r[1], out);
  }
  float *part = grab(sizeof(float) * (size_t)(c->rows * c->n));
  fill(part, c->rows * c->n);
  if (int4) v->int4(codes, d, m, acts, c->n, cut1, cut2, part);
  else v->int8(codes, scale, acts, c->n, cut1, cut2, part);
  for (int64_t a = 0; a < c->rows; a++)
    for (int64_t o = 0; o < c->n; o++) {
      int inside = o / AICI_TILE >= cut1 && o / AICI_TILE < cut2;
      uint32_t got = bits(part[a * c->n + o]);
      if (inside ? got != bits(out[a * c->n + o]) : got != UNWRITTEN)
        fail(inside ? "range differs from the whole" : "wrote outside its tile range",
             v->name, which, c, int4 ? "int4" : "int8", a, o, f32(got), out[a * c->n + o], 0);
    }
  free(part);
}

/* One case: every variant, int4 and int8, against the generic outputs and the model. */
static void run_case(const spec *c, int which) {
  int64_t rows = c->rows, n = c->n, k = c->k, G = k / AICI_GROUP, tiles = n / AICI_TILE;
  float *x = grab(sizeof(float) * (size_t)(rows * k));
  uint16_t *xb = grab(sizeof(uint16_t) * (size_t)(rows * k));
  int8_t *x8 = grab((size_t)(rows * k));
  float *xd = grab(sizeof(float) * (size_t)(rows * G));
  int32_t *s = grab(sizeof(int32_t) * (size_t)(rows * G));
  make_x(c, x, xb);
  check_quantiser(c, x, xb, x8, xd, s, which);
  aici_acts acts = {x8, xd, s, rows, k};

  /* Raw codes [n][k] (int4 0..15 in q4, int8 -128..127 in c8) and scales [n][G]. */
  uint8_t *q4 = grab((size_t)(n * k));
  int8_t *c8 = grab((size_t)(n * k));
  for (int64_t i = 0; i < n * k; i++) {
    int kind = c->codes, hi = below(2);
    q4[i] = (uint8_t)(kind == CODES_MIN        ? 0
                      : kind == CODES_MAX      ? 15
                      : kind == CODES_EXTREMES ? 15 * hi
                                               : below(16));
    c8[i] = (int8_t)(kind == CODES_MIN        ? -128
                     : kind == CODES_MAX      ? 127
                     : kind == CODES_EXTREMES ? 255 * hi - 128
                                              : below(256) - 128);
  }
  size_t per_group = sizeof(uint16_t) * (size_t)(n * G);
  size_t outputs = sizeof(float) * (size_t)(rows * n);
  uint16_t *d = grab(per_group), *m = grab(per_group);
  float *scale = grab(sizeof(float) * (size_t)n);
  for (int64_t i = 0; i < n * G; i++) d[i] = random_half(c->scales), m[i] = random_half(c->scales);
  for (int64_t i = 0; i < n; i++) scale[i] = random_scale(c->scales);

  /* The layouts of int_dot.h; d and m [tiles][G][16]. */
  uint8_t *t4 = grab((size_t)(n * k / 2)), *t8 = grab((size_t)(n * k));
  uint16_t *td = grab(per_group), *tm = grab(per_group);
  for (int64_t o = 0; o < n; o++) {
    int64_t t = o / AICI_TILE, r = o % AICI_TILE;
    for (int64_t g = 0; g < G; g++) {
      td[(t * G + g) * AICI_TILE + r] = d[o * G + g];
      tm[(t * G + g) * AICI_TILE + r] = m[o * G + g];
      const uint8_t *q = q4 + o * k + g * AICI_GROUP;
      const int8_t *w = c8 + o * k + g * AICI_GROUP;
      uint8_t *b4 = t4 + (t * G + g) * 256, *b8 = t8 + (t * G + g) * 512;
      for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++)
          b4[j * 64 + 4 * r + i] = (uint8_t)(q[8 * j + i] | q[8 * j + 4 + i] << 4);
      for (int j = 0; j < 8; j++)
        for (int i = 0; i < 4; i++) b8[j * 64 + 4 * r + i] = (uint8_t)(w[4 * j + i] + 128);
    }
  }

  float *want = grab(outputs), *got = grab(outputs);
  for (int form = 0; form < 2; form++) { /* int4, int8 */
    const char *name = form == 0 ? (c->symmetric ? "int4 symmetric" : "int4") : "int8";
    const uint16_t *mp = c->symmetric ? NULL : tm;
    run_split(&variants[0], form == 0, form == 0 ? t4 : t8, td, mp, scale, &acts, c, want, which);
    for (int64_t a = 0; a < rows; a++)
      for (int64_t o = 0; o < n; o++) {
        double y = 0, mass = 0, floor;
        for (int64_t g = 0; g < G; g++) {
          const int8_t *xa = x8 + a * k + g * AICI_GROUP;
          double xs = xd[a * G + g];
          int64_t dot = 0, sum = 0;
          for (int i = 0; i < AICI_GROUP; i++) {
            int w = form == 1 ? c8[o * k + g * AICI_GROUP + i]
                              : q4[o * k + g * AICI_GROUP + i] - (c->symmetric ? 8 : 0);
            dot += (int64_t)w * xa[i];
            sum += xa[i];
          }
          double dd = half(d[o * G + g]), mm = c->symmetric ? 0 : half(m[o * G + g]);
          double t1 = form == 1 ? xs * (double)dot * scale[o] : dd * xs * (double)dot;
          double t2 = form == 1 ? 0 : mm * xs * (double)sum;
          y += t1 + t2;
          mass += fabs(t1) + fabs(t2);
        }
        floor = form == 1 ? (G + 2) * ldexp(1, -149) * fmax(1.0, fabs(scale[o]))
                          : 2 * G * (ldexp(1, 16) + 2) * ldexp(1, -150);
        double tol = (2 * G + 4) * ldexp(1, -24) * mass + floor;
        double have = want[a * n + o];
        if (!(fabs(have - y) <= tol)) fail("model", "generic", which, c, name, a, o, have, y, tol);
      }
    for (int vi = 1; vi < VARIANTS; vi++) {
      run_split(&variants[vi], form == 0, form == 0 ? t4 : t8, td, mp, scale, &acts, c, got, which);
      for (int64_t i = 0; i < rows * n; i++)
        if (bits(got[i]) != bits(want[i]))
          fail("generic", variants[vi].name, which, c, name, i / n, i % n, got[i], want[i], 0);
    }
  }
  (void)tiles;
  free(x), free(xb), free(x8), free(xd), free(s), free(q4), free(c8), free(d), free(m);
  free(scale), free(t4), free(t8), free(td), free(tm), free(want), free(got);
}

/* Ties go away from zero: amax 127 makes xd 1 and every x8 the rounded input; each
 * quantiser linked in. */
typedef void quantise_fn(const float *, int64_t, int64_t, int8_t *, float *, int32_t *);
static void check_ties_of(const char *name, quantise_fn *quantise) {
  /* 0.49999997 + 0.5 rounds up to 1 in float32: 1, as the operator and its reference */
  float x[AICI_GROUP] = {127.0f, 0.5f,   1.5f,    2.5f,     -0.5f,
                         -1.5f,  -2.5f,  126.5f,  -126.5f,  0.49999997f, -0.0f};
  int8_t want[AICI_GROUP] = {127, 1, 2, 3, -1, -2, -3, 127, -127, 1, 0};
  int8_t x8[AICI_GROUP];
  float xd;
  int32_t s;
  quantise(x, 1, AICI_GROUP, x8, &xd, &s);
  for (int i = 0; i < AICI_GROUP; i++)
    if (x8[i] != want[i]) {
      fprintf(stderr, "FAIL quantise (%s): %.9g rounds to %d, want %d\n", name, x[i], x8[i],
              want[i]);
      exit(1);
    }
  /* A group so small that 1 / xd overflows: divided instead, so its extremes are +-127. */
  float tiny[AICI_GROUP] = {1e-38f, -1e-38f};
  quantise(tiny, 1, AICI_GROUP, x8, &xd, &s);
  if (x8[0] != 127 || x8[1] != -127 || x8[2] != 0 || s != 0) {
    fprintf(stderr, "FAIL quantise (%s): a group of amax 1e-38 gave %d %d %d %d (sum %d)\n",
            name, x8[0], x8[1], x8[2], x8[3], s);
    exit(1);
  }
}

static void check_ties(void) {
  check_ties_of("generic", aici_quantise_f32);
#ifdef AICI_TEST_X86_QUANTISE
  check_ties_of("x86_quantise", aici_quantise_f32_avx2);
#endif
}

int main(int argc, char **argv) {
  rng_state = argc > 1 ? strtoull(argv[1], NULL, 0) : 20240501;
  check_ties();
  static const int ks[] = {32, 64, 96, 128, 160, 256, 512};
  static const int row_counts[] = {1, 2, 3, 4, 5, 7, 8, 9, 13};
  int which = 0;
  /* Every extreme pairing, then random ones. */
  for (int round = 0; round < 2; round++)
    for (int codes = 0; codes < CODES_KINDS; codes++)
      for (int xk = 0; xk < X_KINDS; xk++, which++) {
        spec c = {row_counts[below(9)], AICI_TILE * (1 + below(4)), ks[below(7)], codes, xk,
                  below(SC_KINDS), round, below(2)};
        run_case(&c, which);
      }
  for (int i = 0; i < 250; i++, which++) {
    spec c = {row_counts[below(9)], AICI_TILE * (1 + below(4)), ks[below(7)], below(CODES_KINDS),
              below(X_KINDS), below(SC_KINDS), below(2), below(2)};
    run_case(&c, which);
  }
#ifdef AICI_TEST_X86_QUANTISE
  printf("int_dot x86_quantise: pass (%d cases, bit for bit the generic quantiser)\n", which);
#endif
  for (int vi = 0; vi < VARIANTS; vi++)
    printf("int_dot %s: pass (%d cases, int4 asymmetric/symmetric and int8, %s)\n",
           variants[vi].name, which,
           vi == 0 ? "against a float64 model" : "bit for bit the generic outputs");
  return 0;
}
