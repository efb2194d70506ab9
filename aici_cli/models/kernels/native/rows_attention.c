/* Attention of a few queries a key/value head over each row's own slots: the one-token
 * rows of an eager pass (engine/forward/attention.py's single group), float32 or bf16
 * inputs (rows_attention_body.h, once per type), float32 arithmetic and output.
 *
 * PyTorch's attention over such a group reads every row's keys up to the longest row's
 * length (a mask hides the rest), and the rows sitting the call out (a prompt's row) up
 * to it too; here row s reads its first lengths[s] slots only, and a row of length 0
 * none. The read is the cost: ~3.6 MB a layer for 8 rows of ~300 slots (default model).
 *
 * Per (row s, key/value head g), for each of its R query heads r (the heads that share
 * g), over slots j < L = lengths[s]:
 *   score[r][j] = scale (q[s][g][r] . k[s][g][j])
 *   p = exp(score - max_j score), out[s][g][r] = sum_j p[j] v[s][g][j] / sum_j p[j]
 * in float32 (bf16 inputs widened as read, exactly), keys and values read once each. Its sums run in another order than
 * PyTorch's kernel (the compiler's vector lanes), and exp is a polynomial within ~2 ulp of
 * expf, so results agree with it to float32 rounding, not bit for bit.
 *
 * Built with the variant's instruction-set flags and ATTENTION_FLAGS (int_mm.py):
 * -fassociative-math (the dot products' sums reordered into vector lanes),
 * -fno-signed-zeros, -fno-trapping-math, -fno-math-errno, -ffinite-math-only (fmaxf as
 * one instruction): every loop here vectorises (gcc -fopt-info-vec). Inputs are finite.
 */
#include "rows_attention.h"

#include <stdint.h>
#include <string.h>

/* exp(x) for x <= 0 (scores minus their maximum): Cephes' expf polynomial on the reduced
 * argument, the power of two built in the exponent bits. Plain float and int operations,
 * so that the loop calling it vectorises. exp(x) < 2^-125 reads as 0. */
static inline float exp_nonpositive(float x) {
  x = __builtin_fmaxf(x, -87.0f);
  float n = (float)(int32_t)(x * 1.44269504088896341f - 0.5f); /* round(x log2 e), x <= 0 */
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;         /* x - n ln 2, two parts */
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}


/* A bf16 value as float: its 16 bits are a float's high half (exact). Plain integer
 * operations, so that the loops reading it vectorise. */
static inline float bf16_to_float(uint16_t x) {
  uint32_t bits = (uint32_t)x << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

#define NAME attend_f32
#define ELEM float
#define LOAD(x) (x)
#include "rows_attention_body.h"
#undef NAME
#undef ELEM
#undef LOAD

#define NAME attend_bf16
#define ELEM uint16_t
#define LOAD(x) bf16_to_float(x)
#include "rows_attention_body.h"
#undef NAME
#undef ELEM
#undef LOAD

void aici_rows_attention(const aici_attention_args *a, int64_t item_begin, int64_t item_end,
                         float *scores) {
  if (a->elem == AICI_ELEM_BF16)
    attend_bf16(a, item_begin, item_end, scores);
  else
    attend_f32(a, item_begin, item_end, scores);
}
