/* AVX512-VNNI tiles: the torch operator's arithmetic (int_mm.cpp), without torch.
 * Build: -mavx512f -mavx512bw -mavx512vl -mavx512vnni -mf16c -mfma.
 *
 * A tile's 16 rows are one 512-bit register: lane r holds row r's four bytes of a
 * 64-byte sub-block, so one vpdpbusd (unsigned codes times the four signed activation
 * bytes broadcast) adds four products of all 16 rows, without saturation.
 * Per 512 int4 weights (a group of a tile): 4 loads of 64 bytes, 8 vpdpbusd, ~12 mask
 * and shift ops, one convert and two FMAs: bound by reading the weights. int8: 8 loads,
 * 8 vpdpbusd; the bias 128 comes off once a group as 128 s.
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
  const __m512i low = _mm512_set1_epi8(0x0f);
  int64_t k = q->k;
  __m512 acc[AICI_MAX_ROWS];
  for (int r = 0; r < AICI_MAX_ROWS; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *block = codes + g * (AICI_TILE * AICI_GROUP / 2);
    /* Two groups ahead: the hardware prefetcher alone left ~25% of the bandwidth. */
    AICI_PREFETCH(block, 4);
    __m512i dot[AICI_MAX_ROWS];
    for (int r = 0; r < AICI_MAX_ROWS; r++) dot[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
      __m512i v = _mm512_loadu_si512(block + j * 64);
      __m512i lo = _mm512_and_si512(v, low);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < rows; r++) {
        const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP + j * 8;
        dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(aici_four(xr)));
        dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(aici_four(xr + 4)));
      }
    }
    __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d16 + g * AICI_TILE)));
    for (int r = 0; r < rows; r++) {
      int64_t at = (r0 + r) * groups + g;
      float xs = q->xd[at];
      __m512 dx = _mm512_mul_ps(dv, _mm512_set1_ps(xs));
      if (m16) {
        __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(m16 + g * AICI_TILE)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), dx, acc[r]);
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs * (float)q->s[at]), acc[r]);
      } else {
        __m512i centred = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(8 * q->s[at]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), dx, acc[r]);
      }
    }
  }
  for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * n, acc[r]);
}

/* One int8 tile: scale sum_g xd (dot - 128 s) (scale: the tile's 16). */
AICI_TILE_KERNEL void int8_tile(const uint8_t *codes, const float *scale, int64_t groups, int rows,
                      const aici_acts *q, int64_t r0, float *out, int64_t n) {
  int64_t k = q->k;
  __m512 acc[AICI_MAX_ROWS];
  for (int r = 0; r < AICI_MAX_ROWS; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *block = codes + g * (AICI_TILE * AICI_GROUP);
    AICI_PREFETCH(block, 8);
    __m512i dot[AICI_MAX_ROWS];
    for (int r = 0; r < AICI_MAX_ROWS; r++) dot[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
      __m512i v = _mm512_loadu_si512(block + j * 64);
      for (int r = 0; r < rows; r++) {
        const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP + j * 4;
        dot[r] = _mm512_dpbusd_epi32(dot[r], v, _mm512_set1_epi32(aici_four(xr)));
      }
    }
    for (int r = 0; r < rows; r++) {
      int64_t at = (r0 + r) * groups + g;
      __m512i centred = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * q->s[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(q->xd[at]), acc[r]);
    }
  }
  __m512 sv = _mm512_loadu_ps(scale);
  for (int r = 0; r < rows; r++) _mm512_storeu_ps(out + r * n, _mm512_mul_ps(acc[r], sv));
}

AICI_TILE_WALKS(aici_int4_tiles_avx512_vnni, aici_int8_tiles_avx512_vnni)
