/* AArch64 NEON tiles, two builds of this one file (their symbols differ, so both can be
 * linked into one program and picked by HWCAP_ASIMDDP at run time):
 *   -march=armv8.2-a+dotprod (__ARM_FEATURE_DOTPROD): aici_int{4,8}_tiles_neon_dot, sdot;
 *   -march=armv8-a:                                    aici_int{4,8}_tiles_neon, smull.
 *
 * A tile's 64-byte sub-block is four 128-bit registers (quarter c: rows 4 c .. 4 c + 3, lane r
 * holds row r's four bytes). sdot is signed by signed, so the codes go in signed:
 * int4 codes 0..15 as they are; int8 bytes c + 128 as w = c (byte ^ 0x80), whose sum
 * is dot - 128 s itself. The activations' group is two registers, its 4-byte steps
 * their lanes (vdotq_laneq_s32: no broadcast).
 * Without sdot: vmull_s8/vmull_high_s8 (w x8 fits int16: at most 128 127) and
 * vpadalq_s16 add pairs into int32 lanes (two per row), pairs of lanes are added once a
 * group (vpaddq_s32), so a lane again holds one row's sum.
 * Cost per group of a tile (512 weights) and activation row: 32 sdot (without: 64
 * smull and 64 sadalp), plus 8 mask/shift (int4) or 8 eor (int8) per quarter shared by
 * the rows. The float step is the other variants' (vfmaq_f32 is fused, lane by lane), so
 * results are bit for bit theirs.
 */
#include <arm_neon.h>
#include <stddef.h>

#include "int_dot.h"
#include "tiles.h"

#ifdef __ARM_FEATURE_DOTPROD
#define SUFFIX(name) name##_neon_dot
#else
#define SUFFIX(name) name##_neon
#endif

/* acc (4 rows' int32 sums in acc[0], or their 8 pair sums in acc[0..1] without sdot) +=
 * w times the 4 bytes of lane `lane` of xv (a constant), each lane its row's four. */
#ifdef __ARM_FEATURE_DOTPROD
#define STEP(acc, w, xv, lane) ((acc)[0] = vdotq_laneq_s32((acc)[0], (w), (xv), (lane)))
#else
#define STEP(acc, w, xv, lane)                                                          \
  do {                                                                                  \
    int8x16_t xb_ = vreinterpretq_s8_s32(vdupq_laneq_s32(vreinterpretq_s32_s8(xv), lane)); \
    (acc)[0] = vpadalq_s16((acc)[0], vmull_s8(vget_low_s8(w), vget_low_s8(xb_)));     \
    (acc)[1] = vpadalq_s16((acc)[1], vmull_high_s8((w), xb_));                         \
  } while (0)
#endif

/* The 4 rows' sums of a block of accumulators. */
static inline int32x4_t sums(const int32x4_t acc[2]) {
#ifdef __ARM_FEATURE_DOTPROD
  return acc[0];
#else
  return vpaddq_s32(acc[0], acc[1]);
#endif
}

/* 4 of a tile's 16 float16 scales, as float. */
static inline float32x4_t halves(const uint16_t *p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

/* One int4 tile for rows r0 .. r0 + rows - 1 (rows <= AICI_MAX_ROWS), into out (the
 * tile's first output of row r0) and on at out + n, out + 2 n, ... A group goes a
 * quarter (4 weight rows) at a time: its 8 nibble registers, then every activation row. */
AICI_TILE_KERNEL void int4_tile(const uint8_t *codes, const uint16_t *d16, const uint16_t *m16,
                      int64_t groups, int rows, const aici_acts *q, int64_t r0, float *out,
                      int64_t n) {
  const uint8x16_t low = vdupq_n_u8(0x0f);
  int64_t k = q->k;
  float32x4_t acc[AICI_MAX_ROWS][4];
  for (int r = 0; r < AICI_MAX_ROWS; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *block = codes + g * (AICI_TILE * AICI_GROUP / 2);
    int8x16_t x[AICI_MAX_ROWS][2];
    for (int r = 0; r < rows; r++) {
      const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP;
      x[r][0] = vld1q_s8(xr);
      x[r][1] = vld1q_s8(xr + 16);
    }
    for (int c = 0; c < 4; c++) {
      int8x16_t w[8]; /* sub-block j: low nibbles (2 j) with x[8 j ..], high with x[8 j + 4 ..] */
      for (int j = 0; j < 4; j++) {
        uint8x16_t v = vld1q_u8(block + j * 64 + c * 16);
        w[2 * j] = vreinterpretq_s8_u8(vandq_u8(v, low));
        w[2 * j + 1] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
      }
      float32x4_t dv = halves(d16 + g * AICI_TILE + c * 4);
      for (int r = 0; r < rows; r++) {
        int32x4_t dot[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        STEP(dot, w[0], x[r][0], 0);
        STEP(dot, w[1], x[r][0], 1);
        STEP(dot, w[2], x[r][0], 2);
        STEP(dot, w[3], x[r][0], 3);
        STEP(dot, w[4], x[r][1], 0);
        STEP(dot, w[5], x[r][1], 1);
        STEP(dot, w[6], x[r][1], 2);
        STEP(dot, w[7], x[r][1], 3);
        int64_t at = (r0 + r) * groups + g;
        float xs = q->xd[at];
        if (m16) {
          float32x4_t mv = halves(m16 + g * AICI_TILE + c * 4);
          acc[r][c] = vfmaq_f32(acc[r][c], vcvtq_f32_s32(sums(dot)), vmulq_n_f32(dv, xs));
          acc[r][c] = vfmaq_f32(acc[r][c], mv, vdupq_n_f32(xs * (float)q->s[at]));
        } else {
          int32x4_t centred = vsubq_s32(sums(dot), vdupq_n_s32(8 * q->s[at]));
          acc[r][c] = vfmaq_f32(acc[r][c], vcvtq_f32_s32(centred), vmulq_n_f32(dv, xs));
        }
      }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < 4; c++) vst1q_f32(out + r * n + c * 4, acc[r][c]);
}

/* One int8 tile: scale sum_g xd sum w x8 (w = c, so no bias to take off). */
AICI_TILE_KERNEL void int8_tile(const uint8_t *codes, const float *scale, int64_t groups, int rows,
                      const aici_acts *q, int64_t r0, float *out, int64_t n) {
  const uint8x16_t bias = vdupq_n_u8(0x80);
  int64_t k = q->k;
  float32x4_t acc[AICI_MAX_ROWS][4];
  for (int r = 0; r < AICI_MAX_ROWS; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = vdupq_n_f32(0.0f);
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t *block = codes + g * (AICI_TILE * AICI_GROUP);
    int8x16_t x[AICI_MAX_ROWS][2];
    for (int r = 0; r < rows; r++) {
      const int8_t *xr = q->x8 + (r0 + r) * k + g * AICI_GROUP;
      x[r][0] = vld1q_s8(xr);
      x[r][1] = vld1q_s8(xr + 16);
    }
    for (int c = 0; c < 4; c++) {
      int8x16_t w[8]; /* sub-block j with x[4 j ..] */
      for (int j = 0; j < 8; j++)
        w[j] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(block + j * 64 + c * 16), bias));
      for (int r = 0; r < rows; r++) {
        int32x4_t dot[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
        STEP(dot, w[0], x[r][0], 0);
        STEP(dot, w[1], x[r][0], 1);
        STEP(dot, w[2], x[r][0], 2);
        STEP(dot, w[3], x[r][0], 3);
        STEP(dot, w[4], x[r][1], 0);
        STEP(dot, w[5], x[r][1], 1);
        STEP(dot, w[6], x[r][1], 2);
        STEP(dot, w[7], x[r][1], 3);
        float xs = q->xd[(r0 + r) * groups + g];
        acc[r][c] = vfmaq_f32(acc[r][c], vcvtq_f32_s32(sums(dot)), vdupq_n_f32(xs));
      }
    }
  }
  for (int c = 0; c < 4; c++) {
    float32x4_t sv = vld1q_f32(scale + c * 4);
    for (int r = 0; r < rows; r++) vst1q_f32(out + r * n + c * 4, vmulq_f32(acc[r][c], sv));
  }
}

AICI_TILE_WALKS(SUFFIX(aici_int4_tiles), SUFFIX(aici_int8_tiles))
