/* Attention over each row's own cache slots for rows of one query position
 * (rows_attention.c; the torch operator `aici::rows_attention` in ../int_mm.cpp). */
#ifndef AICI_ROWS_ATTENTION_H
#define AICI_ROWS_ATTENTION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { AICI_MAX_REP = 16 }; /* query heads a key/value head */

/* The element type of q, k and v (the arithmetic and `out` are float32 either way). */
typedef enum aici_attention_elem { AICI_ELEM_F32 = 0, AICI_ELEM_BF16 = 1 } aici_attention_elem;

typedef struct aici_attention_args {
  const void *q; /* [S][G][R][D] of `elem`, strides in elements (D contiguous) */
  int64_t q_stride[3];
  const void *k; /* [>= S][G][>= max length][D] */
  int64_t k_stride[3];
  const void *v;
  int64_t v_stride[3];
  const int64_t *lengths; /* [S]: row s attends slots 0 .. lengths[s] - 1 (0: none) */
  int64_t kv_heads, rep, dim; /* G, R <= AICI_MAX_REP, D */
  float scale;
  float *out; /* [S][G][R][D] contiguous; a row of length 0 gets zeros */
  aici_attention_elem elem; /* q, k and v's */
} aici_attention_args;

/* Items item_begin .. item_end - 1 (item = s G + g); `scores`: R max(lengths) floats of
 * scratch. No allocation, no state: threads may run disjoint ranges at once. */
void aici_rows_attention(const aici_attention_args *a, int64_t item_begin, int64_t item_end,
                         float *scores);

#ifdef __cplusplus
}
#endif

#endif /* AICI_ROWS_ATTENTION_H */
