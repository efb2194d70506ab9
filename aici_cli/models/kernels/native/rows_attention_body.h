/* The body of rows_attention.c's attention for one element type of q, k and v, included
 * there once per type: NAME (the function), ELEM (the stored type) and LOAD (an ELEM read
 * as float) are defined by the includer. Every product and sum is float32 whatever ELEM
 * is, so a bf16 row gets the float32 computation of its bf16 inputs. */

static void NAME(const aici_attention_args *a, int64_t item_begin, int64_t item_end,
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
    const ELEM *q = (const ELEM *)a->q + s * a->q_stride[0] + g * a->q_stride[1];
    const ELEM *k = (const ELEM *)a->k + s * a->k_stride[0] + g * a->k_stride[1];
    const ELEM *v = (const ELEM *)a->v + s * a->v_stride[0] + g * a->v_stride[1];
    float top[AICI_MAX_REP], sum[AICI_MAX_REP];
    for (int64_t r = 0; r < R; r++) top[r] = -3.0e38f;
    for (int64_t j = 0; j < L; j++) {
      const ELEM *kj = k + j * a->k_stride[2];
      for (int64_t r = 0; r < R; r++) {
        const ELEM *qr = q + r * a->q_stride[2];
        float dot = 0.0f;
        for (int64_t d = 0; d < D; d++) dot += LOAD(qr[d]) * LOAD(kj[d]);
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
      const ELEM *vj = v + j * a->v_stride[2];
      for (int64_t r = 0; r < R; r++) {
        float w = scores[r * L + j], *o = out + r * D;
        for (int64_t d = 0; d < D; d++) o[d] += w * LOAD(vj[d]);
      }
    }
    for (int64_t r = 0; r < R; r++) {
      float inv = 1.0f / sum[r], *o = out + r * D;
      for (int64_t d = 0; d < D; d++) o[d] *= inv;
    }
  }
}
