/* AVX2 tiles, for x86 CPUs without a byte dot product (Haswell .. Comet Lake, Zen 1-3).
 * Build: -mavx2 -mfma -mf16c.
 *
 * A tile's 64-byte sub-block is two registers (rows 0..7, rows 8..15; lane r holds row
 * r's four bytes). vpmaddubsw multiplies unsigned by signed bytes and adds adjacent
 * pairs into int16 WITH SATURATION; vpmaddwd by ones then adds int16 pairs into the
 * int32 lane: together one vpdpbusd, as long as no int16 saturates.
 *
 *   int4: codes 0..15 times x8 in -127..127: a pair is at most 2 15 127 = 3810, so the
 *         whole group's 8 pairs (4 sub-blocks, low and high nibbles) add up in int16
 *         (8 3810 = 30480 < 32767): one vpmaddwd per register a group, not per step.
 *   int8: the stored bytes c + 128 (up to 255) times x8 reach 2 255 127 = 64770: they
 *         would saturate. So the signed code w = c (byte ^ 0x80, -128..127) is used,
 *         as vpmaddubsw(|w|, sign(x8, w)) = w x8 per byte: |w| <= 128 fits the unsigned
 *         operand, x8 (never -128) survives the sign change, and a pair is at most
 *         2 128 127 = 32512. The sum is then dot - 128 s itself. (The other order,
 *         vpmaddubsw(|x8|, sign(w, x8)), is wrong at w = -128, code 0: its negation
 *         wraps back to -128.) One vpmaddwd per step: two pairs could reach 65024.
 * Cost against vpdpbusd: 2 instructions a step (int4 ~1.25 with the deferred vpmaddwd),
 * 4 for int8 (abs is per register, sign/maddubs/maddwd/add per row).
 */
#include <immintrin.h>
#include <string.h>

#include "int_dot.h"
#include "tiles.h"

/* One int4 tile for rows r0 .. r0 + rows - 1 (rows <= AICI_MAX_ROWS), into out (the
 * tile's first output of row r0) and on at out + n, out + 2 n, ... */
AICI_TILE_KERNEL void int4_tile(const uint8_t *codes, const uint16_t *d16, const uint16_t *m16,
                      int64_t groups, int rows, const aici_acts *q, int64_t r0, float *out,
                      int64_t n) {
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  int64_t k = q->k;
  __m256 acc[AICI_MAX_ROWS][2];
  for (int r = 0; r < AICI_MAX_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *block = codes + g * (AICI_TILE * AICI_GROUP / 2);
    AICI_PREFETCH(block, 4);
    __m256i pairs[AICI_MAX_ROWS][2]; /* int16, at most 30480 in magnitude (above) */
    for (int r = 0; r < AICI_MAX_ROWS; r++) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
      for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(block + j * 64 + h * 32));
        __m256i lo = _mm256_and_si256(v, low);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < rows; r++) {
          const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP + j * 8;
          __m256i a = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(aici_four(xr)));
          __m256i b = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(aici_four(xr + 4)));
          pairs[r][h] = _mm256_add_epi16(pairs[r][h], _mm256_add_epi16(a, b));
        }
      }
    }
    for (int h = 0; h < 2; h++) {
      __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d16 + g * AICI_TILE + h * 8)));
      for (int r = 0; r < rows; r++) {
        int64_t at = (r0 + r) * groups + g;
        float xs = q->xd[at];
        __m256i dot = _mm256_madd_epi16(pairs[r][h], ones);
        __m256 dx = _mm256_mul_ps(dv, _mm256_set1_ps(xs));
        if (m16) {
          const uint16_t *mh = m16 + g * AICI_TILE + h * 8;
          __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs * (float)q->s[at]), acc[r][h]);
        } else {
          __m256i centred = _mm256_sub_epi32(dot, _mm256_set1_epi32(8 * q->s[at]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), dx, acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * n + h * 8, acc[r][h]);
}

/* One int8 tile: scale sum_g xd sum w x8 (w = c, so no bias to take off). */
AICI_TILE_KERNEL void int8_tile(const uint8_t *codes, const float *scale, int64_t groups, int rows,
                      const aici_acts *q, int64_t r0, float *out, int64_t n) {
  const __m256i bias = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  int64_t k = q->k;
  __m256 acc[AICI_MAX_ROWS][2];
  for (int r = 0; r < AICI_MAX_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *block = codes + g * (AICI_TILE * AICI_GROUP);
    AICI_PREFETCH(block, 8);
    __m256i dot[AICI_MAX_ROWS][2];
    for (int r = 0; r < AICI_MAX_ROWS; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
      for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(block + j * 64 + h * 32));
        __m256i w = _mm256_xor_si256(v, bias);
        __m256i aw = _mm256_abs_epi8(w); /* -128 -> 0x80, read as unsigned 128 */
        for (int r = 0; r < rows; r++) {
          const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP + j * 4;
          __m256i sx = _mm256_sign_epi8(_mm256_set1_epi32(aici_four(xr)), w);
          __m256i pair = _mm256_maddubs_epi16(aw, sx); /* at most 32512: no saturation */
          dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pair, ones));
        }
      }
    }
    for (int r = 0; r < rows; r++) {
      __m256 xs = _mm256_set1_ps(q->xd[(r0 + r) * groups + g]);
      for (int h = 0; h < 2; h++)
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), xs, acc[r][h]);
    }
  }
  for (int h = 0; h < 2; h++) {
    __m256 sv = _mm256_loadu_ps(scale + h * 8);
    for (int r = 0; r < rows; r++)
      _mm256_storeu_ps(out + r * n + h * 8, _mm256_mul_ps(acc[r][h], sv));
  }
}

AICI_TILE_WALKS(aici_int4_tiles_avx2, aici_int8_tiles_avx2)
