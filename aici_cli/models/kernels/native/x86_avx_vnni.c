/* AVX-VNNI tiles: the AVX512-VNNI variant's arithmetic in 256-bit VEX registers, for
 * CPUs with vpdpbusd but no AVX-512 (Alder Lake and later client cores, some Atoms).
 * Build: -mavx2 -mavxvnni -mf16c -mfma.
 *
 * A tile's 64-byte sub-block is two registers: rows 0..7 and rows 8..15, lane r holding
 * row r's four bytes; _mm256_dpbusd_avx_epi32 (unsigned codes times the four signed
 * activation bytes broadcast) adds four products of 8 rows, without saturation.
 * Per int4 group of a tile: 8 loads of 32 bytes, 16 vpdpbusd a row, twice the
 * AVX512-VNNI's instructions for the same bytes; int8 likewise.
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
  const __m256i low = _mm256_set1_epi8(0x0f);
  int64_t k = q->k;
  __m256 acc[AICI_MAX_ROWS][2];
  for (int r = 0; r < AICI_MAX_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *block = codes + g * (AICI_TILE * AICI_GROUP / 2);
    AICI_PREFETCH(block, 4);
    __m256i dot[AICI_MAX_ROWS][2];
    for (int r = 0; r < AICI_MAX_ROWS; r++) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
      for (int h = 0; h < 2; h++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(block + j * 64 + h * 32));
        __m256i lo = _mm256_and_si256(v, low);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < rows; r++) {
          const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP + j * 8;
          dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], lo, _mm256_set1_epi32(aici_four(xr)));
          dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], hi, _mm256_set1_epi32(aici_four(xr + 4)));
        }
      }
    }
    for (int h = 0; h < 2; h++) {
      const uint16_t *dh = d16 + g * AICI_TILE + h * 8;
      __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)dh));
      for (int r = 0; r < rows; r++) {
        int64_t at = (r0 + r) * groups + g;
        float xs = q->xd[at];
        __m256 dx = _mm256_mul_ps(dv, _mm256_set1_ps(xs));
        if (m16) {
          const uint16_t *mh = m16 + g * AICI_TILE + h * 8;
          __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)mh));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), dx, acc[r][h]);
          acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs * (float)q->s[at]), acc[r][h]);
        } else {
          __m256i centred = _mm256_sub_epi32(dot[r][h], _mm256_set1_epi32(8 * q->s[at]));
          acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(centred), dx, acc[r][h]);
        }
      }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + r * n + h * 8, acc[r][h]);
}

/* One int8 tile: scale sum_g xd (dot - 128 s) (scale: the tile's 16). */
AICI_TILE_KERNEL void int8_tile(const uint8_t *codes, const float *scale, int64_t groups, int rows,
                      const aici_acts *q, int64_t r0, float *out, int64_t n) {
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
        for (int r = 0; r < rows; r++) {
          const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP + j * 4;
          dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], v, _mm256_set1_epi32(aici_four(xr)));
        }
      }
    }
    for (int r = 0; r < rows; r++) {
      int64_t at = (r0 + r) * groups + g;
      __m256i bias = _mm256_set1_epi32(128 * q->s[at]);
      __m256 xs = _mm256_set1_ps(q->xd[at]);
      for (int h = 0; h < 2; h++) {
        __m256 centred = _mm256_cvtepi32_ps(_mm256_sub_epi32(dot[r][h], bias));
        acc[r][h] = _mm256_fmadd_ps(centred, xs, acc[r][h]);
      }
    }
  }
  for (int h = 0; h < 2; h++) {
    __m256 sv = _mm256_loadu_ps(scale + h * 8);
    for (int r = 0; r < rows; r++)
      _mm256_storeu_ps(out + r * n + h * 8, _mm256_mul_ps(acc[r][h], sv));
  }
}

AICI_TILE_WALKS(aici_int4_tiles_avx_vnni, aici_int8_tiles_avx_vnni)
