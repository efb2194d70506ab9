/* What every instruction set's variant shares around its two tile kernels: the walk over
 * a range of 16-row tiles and over the activation rows, AICI_MAX_ROWS at a time (the
 * tile's weights are read once per that many rows), and a 4-byte load.
 *
 * A variant defines, before AICI_TILE_WALKS(int4_name, int8_name):
 *   static void int4_tile(codes, d16, m16, groups, rows, q, r0, out, n);
 *   static void int8_tile(codes, scale, groups, rows, q, r0, out, n);
 * each computing one tile (its codes and scales from their first byte) for activation
 * rows r0 .. r0 + rows - 1 into out (the tile's first output of row r0; row r0 + i at
 * out + i n). The macro then defines the variant's two functions of int_dot.h.
 */
#ifndef AICI_TILES_H
#define AICI_TILES_H

#include <string.h>

#include "int_dot.h"

/* A tile kernel is inlined into the walk once per row count (1 .. AICI_MAX_ROWS, each a
 * constant there): its per-row accumulators then live in registers, where a row count
 * known only at run time left them on the stack (a decode step's one row ran at about
 * half the speed). */
#define AICI_TILE_KERNEL static inline __attribute__((always_inline))

/* `call` with `rows` as the constant it equals (1 .. AICI_MAX_ROWS). */
#define AICI_WITH_ROWS(rows, call) \
  switch (rows) {                  \
    case 1: { enum { R = 1 }; call; } break; \
    case 2: { enum { R = 2 }; call; } break; \
    case 3: { enum { R = 3 }; call; } break; \
    default: { enum { R = AICI_MAX_ROWS }; call; } break; \
  }

/* Each group's lines are prefetched this many bytes ahead of the group being read: 8 int4
 * groups (4 of int8), far enough to cover the memory's latency while a tile streams from
 * DRAM. The hardware's own prefetcher stops at each 4 KiB page; at 512 bytes ahead a
 * one-row product of a 5632 x 2048 int4 layer read 27 GB/s on a 2-core Xeon whose `sum`
 * reads 58; at 2048, 32 GB/s (bench/int_kernels.py --stream). */
#define AICI_PREFETCH_AHEAD 2048
#define AICI_PREFETCH(block, lines)                                                   \
  for (int line_ = 0; line_ < (lines); line_++)                                       \
    __builtin_prefetch((const char *)(block) + AICI_PREFETCH_AHEAD + line_ * 64, 0, 3)

static inline int32_t aici_four(const int8_t *p) {
  int32_t v;
  memcpy(&v, p, 4);
  return v;
}

#define AICI_TILE_WALKS(int4_name, int8_name)                                              \
  void int4_name(const uint8_t *codes, const uint16_t *d, const uint16_t *m,              \
                 const aici_acts *acts, int64_t n, int64_t tile_begin, int64_t tile_end,  \
                 float *out) {                                                            \
    int64_t groups = acts->k / AICI_GROUP;                                                \
    for (int64_t t = tile_begin; t < tile_end; t++) {                                     \
      for (int64_t r0 = 0; r0 < acts->rows; r0 += AICI_MAX_ROWS) {                        \
        int rows = (int)(acts->rows - r0 < AICI_MAX_ROWS ? acts->rows - r0 : AICI_MAX_ROWS); \
        AICI_WITH_ROWS(rows, int4_tile(codes + t * groups * (AICI_TILE * AICI_GROUP / 2), \
                  d + t * groups * AICI_TILE, m ? m + t * groups * AICI_TILE : NULL,      \
                  groups, R, acts, r0, out + r0 * n + t * AICI_TILE, n))                  \
      }                                                                                   \
    }                                                                                     \
  }                                                                                       \
  void int8_name(const uint8_t *codes, const float *scale, const aici_acts *acts,         \
                 int64_t n, int64_t tile_begin, int64_t tile_end, float *out) {           \
    int64_t groups = acts->k / AICI_GROUP;                                                \
    for (int64_t t = tile_begin; t < tile_end; t++) {                                     \
      for (int64_t r0 = 0; r0 < acts->rows; r0 += AICI_MAX_ROWS) {                        \
        int rows = (int)(acts->rows - r0 < AICI_MAX_ROWS ? acts->rows - r0 : AICI_MAX_ROWS); \
        AICI_WITH_ROWS(rows, int8_tile(codes + t * groups * (AICI_TILE * AICI_GROUP),     \
                  scale + t * AICI_TILE, groups, R, acts, r0, out + r0 * n + t * AICI_TILE, n)) \
      }                                                                                   \
    }                                                                                     \
  }

#endif /* AICI_TILES_H */
