/* Group-32 int4 and per-channel int8 weights times int8-quantised activations: the
 * arithmetic of the torch operators in ../int_mm.cpp (`aici::int4_vnni_mm`,
 * `int8_vnni_mm`) as plain C, without torch and without threads, one variant per
 * instruction set. A caller (the torch operator, a test, a benchmark) quantises the
 * activations once, then runs a variant over ranges of 16-row tiles, from as many
 * threads as it likes: tiles are independent and write disjoint outputs.
 *
 * Activations, per group of 32 inputs (llama.cpp's Q8_0): x = xd x8, x8 in -127..127,
 * xd = amax / 127 (float32), x8 = v (1 / xd) rounded to nearest, ties away from zero
 * (0 where the group is all zeros), s = sum of the group's x8. Inputs must be finite.
 * Where 1 / xd overflows (amax < ~3.7e-37) x8 = v / xd: the torch operator's conversion
 * of inf to int is undefined there (on x86 every element of the group becomes -127).
 *
 * Weights, tiled by aici_cli/models/kernels/int_mm.py (`tile_int4`, `tile_int8`): rows in
 * tiles of 16, each tile's k/32 groups in order.
 *   int4: a group is 256 bytes, 4 sub-blocks of 64; byte 4 r + i of sub-block j holds
 *         row r's codes k = 8 j + i (low nibble) and 8 j + 4 + i (high nibble), codes
 *         q in 0..15, weight = q d + m. d and m: [tiles][groups][16] float16 bits.
 *         m NULL: symmetric (m = -8 d), folded into the integer sum as dot - 8 s.
 *   int8: a group is 512 bytes, 8 sub-blocks of 64; byte 4 r + i of sub-block j holds
 *         row r's code k = 4 j + i as the unsigned byte c + 128 (c in -128..127);
 *         weight = c scale[row], scale: [n] float32.
 * So a 32-bit lane holds four consecutive products of one row: one dot-product step
 * (vpdpbusd, vdot, maddubs + madd) adds four products of each of 16 rows.
 *
 * Per output (activation row a, weight row o) and group g, in group order, float32:
 *   int4 (m): acc = fma(float(dot), d xd, acc); acc = fma(m, xd float(s), acc)
 *   int4:     acc = fma(float(dot - 8 s), d xd, acc)
 *   int8:     acc = fma(float(dot - 128 s), xd, acc); at the end out = acc scale
 * where dot = sum of code x8 over the group (exact in int32: at most 32 255 127; the
 * float conversions are exact too, below 2^24), d xd and xd float(s) rounded float32
 * products, fma fused. Every variant performs exactly these float operations in this
 * order, so all agree bit for bit with the generic one; only the integer dot's
 * instructions differ.
 *
 * Outputs: out[a * n + o] float32 for every activation row a < acts->rows and every
 * weight row o of the tiles in [tile_begin, tile_end); nothing else is written.
 * Activation rows go through a tile AICI_MAX_ROWS at a time (the weights are read once
 * per AICI_MAX_ROWS rows). No allocation, no state, no global data. A bfloat16 result
 * is the caller's rounding of these floats.
 */
#ifndef AICI_INT_DOT_H
#define AICI_INT_DOT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { AICI_TILE = 16, AICI_GROUP = 32, AICI_MAX_ROWS = 4 };

/* Quantised activations, [rows][k] and [rows][k / 32]; k a multiple of 32. */
typedef struct aici_acts {
  const int8_t *x8;
  const float *xd;
  const int32_t *s;
  int64_t rows, k;
} aici_acts;

/* x [rows][k] (float32, or bfloat16 as its 16 bits) into x8 [rows][k], xd and s
 * [rows][k / 32], caller-allocated (generic.c; the same on every CPU). */
void aici_quantise_f32(const float *x, int64_t rows, int64_t k, int8_t *x8, float *xd,
                       int32_t *s);
void aici_quantise_bf16(const uint16_t *x, int64_t rows, int64_t k, int8_t *x8, float *xd,
                        int32_t *s);
/* The same in AVX2 (x86_quantise.c: -mavx2 -mfma -mf16c), bit for bit, ~3x faster: what
 * every x86 variant's operator calls. */
void aici_quantise_f32_avx2(const float *x, int64_t rows, int64_t k, int8_t *x8, float *xd,
                            int32_t *s);
void aici_quantise_bf16_avx2(const uint16_t *x, int64_t rows, int64_t k, int8_t *x8,
                             float *xd, int32_t *s);

/* The tiles [tile_begin, tile_end) of an [n, k] int4 matrix (codes, d, m: the whole
 * matrix's, tile t at codes + t (k/32) 256, d + t (k/32) 16) times acts. */
typedef void aici_int4_tiles_fn(const uint8_t *codes, const uint16_t *d, const uint16_t *m,
                                const aici_acts *acts, int64_t n, int64_t tile_begin,
                                int64_t tile_end, float *out);
/* The same for an [n, k] int8 matrix (tile t at codes + t (k/32) 512), scale [n]. */
typedef void aici_int8_tiles_fn(const uint8_t *codes, const float *scale,
                                const aici_acts *acts, int64_t n, int64_t tile_begin,
                                int64_t tile_end, float *out);

/* Each pair is defined by one file, compiled with its own instruction-set flags; a
 * caller calls one only on a CPU that has them (no dispatch here). */
aici_int4_tiles_fn aici_int4_tiles_generic;     /* generic.c: any CPU */
aici_int8_tiles_fn aici_int8_tiles_generic;
aici_int4_tiles_fn aici_int4_tiles_avx512_vnni; /* x86_avx512_vnni.c: AVX512 F/BW/VL/VNNI, */
aici_int8_tiles_fn aici_int8_tiles_avx512_vnni; /* F16C, FMA */
aici_int4_tiles_fn aici_int4_tiles_avx_vnni;    /* x86_avx_vnni.c: AVX-VNNI, AVX2, F16C, FMA */
aici_int8_tiles_fn aici_int8_tiles_avx_vnni;
aici_int4_tiles_fn aici_int4_tiles_avx2;        /* x86_avx2.c: AVX2, F16C, FMA */
aici_int8_tiles_fn aici_int8_tiles_avx2;
aici_int4_tiles_fn aici_int4_tiles_neon_dot;    /* arm_neon.c built with the dot product */
aici_int8_tiles_fn aici_int8_tiles_neon_dot;    /* (__ARM_FEATURE_DOTPROD: armv8.2-a+dotprod) */
aici_int4_tiles_fn aici_int4_tiles_neon;        /* arm_neon.c built without it (armv8-a) */
aici_int8_tiles_fn aici_int8_tiles_neon;

#ifdef __cplusplus
}
#endif

#endif /* AICI_INT_DOT_H */
