/* Attention of a few queries a key/value head over each row's own slots: the one-token
 * rows of an eager pass (engine/forward/attention.py's single group), float32.
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
 * in float32, keys and values read once each. Its sums run in another order than
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

void aici_rows_attention(const aici_attention_args *a, int64_t item_begin, int64_t item_end,
                         float *scores) {
  const int64_t R = a->rep, D = a->dim;
  for (int64_t item = item_begin; item < item_end; item++) {
    const int64_t s = item / a->kv_heads, g = item % a->kv_heads;
    const int64_t L = a->lengths[s];
    float *out = a->out + item * R * D; /* [S][G][R][D], contiguous */
    if (L <= 0) {
      memset(out, 0, (size_t)(R * D) * sizeof(float));
      continue;
    }
    const float *q = a->q + s * a->q_stride[0] + g * a->q_stride[1];
    const float *k = a->k + s * a->k_stride[0] + g * a->k_stride[1];
    const float *v = a->v + s * a->v_stride[0] + g * a->v_stride[1];
    float top[AICI_MAX_REP], sum[AICI_MAX_REP];
    for (int64_t r = 0; r < R; r++) top[r] = -3.0e38f;
    for (int64_t j = 0; j < L; j++) {
      const float *kj = k + j * a->k_stride[2];
      for (int64_t r = 0; r < R; r++) {
        const float *qr = q + r * a->q_stride[2];
        float dot = 0.0f;
        for (int64_t d = 0; d < D; d++) dot += qr[d] * kj[d];
        dot *= a->scale;
        scores[r * L + j] = dot;
        top[r] = dot > top[r] ? dot : top[r];
      }
    }
    for (int64_t r = 0; r < R; r++) {
      float *row = scores + r * L, m = top[r], total = 0.0f;
      for (int64_t j = 0; j < L; j++) {
        float p = exp_nonpositive(row[j] - m);
        row[j] = p;
        total += p;
      }
      sum[r] = total;
    }
    memset(out, 0, (size_t)(R * D) * sizeof(float));
    for (int64_t j = 0; j < L; j++) {
      const float *vj = v + j * a->v_stride[2];
      for (int64_t r = 0; r < R; r++) {
        float w = scores[r * L + j], *o = out + r * D;
        for (int64_t d = 0; d < D; d++) o[d] += w * vj[d];
      }
    }
    for (int64_t r = 0; r < R; r++) {
      float inv = 1.0f / sum[r], *o = out + r * D;
      for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
  }
}
