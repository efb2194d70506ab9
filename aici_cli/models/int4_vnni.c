/* Group-32 int4 weights times int8-quantised activations on AVX512-VNNI (`int4_vnni.py`).
 *
 * y[m, n] = sum_g d[n,g] xd[m,g] (sum_{k in g} q[n,k] x8[m,k]) + m[n,g] xd[m,g] s[m,g]
 *
 * where weight = q d + m per group of 32 inputs (q in 0..15), the activations are
 * quantised per group of 32 as x = xd x8 (x8 in -127..127, xd = amax / 127, as llama.cpp's
 * Q8_0) and s[m,g] = sum_{k in g} x8[m,k]. A symmetric layer (m = -8 d: GGUF Q4_0) keeps no
 * m: its term is -8 d xd s, folded into the integer sum.
 *
 * Layout (`tiles`): rows in tiles of 16, each tile's groups in order; a group is 4
 * sub-blocks of 64 bytes, byte 4 r + i of sub-block j holding row r's codes k = 8 j + i
 * (low nibble) and 8 j + 4 + i (high nibble), i in 0..3. So one vpdpbusd adds four
 * products of each of the 16 rows into its lane, with the activations' four bytes
 * broadcast: 2 vpdpbusd per 64 bytes read, and the scales multiplied once per group for
 * 16 rows at once. Scales: [tiles][groups][16] fp16 d (and m).
 *
 * Per 512 weights (one group of a tile): 4 loads of 64 bytes, 8 vpdpbusd, 12 mask/shift
 * ops, one convert and two FMAs, so the step is bound by reading the weights, not by
 * widening them (PyTorch's CPU int4 kernel widens every weight to float first).
 *
 * Threads: OpenMP over tiles; the library links libgomp.so.1, which resolves to the one
 * PyTorch already loaded (same soname), so both share one pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE 16
#define GROUP 32
#define MAX_ROWS 4 /* activation rows per pass over a tile's weights */

/* Activation rows in float32 or bf16 -> per group: x8 (K bytes), xd (K/32 floats) and
 * s (K/32 int32). Rounding: nearest, ties away from zero (lrintf would be ties-to-even;
 * the reference in int4_vnni.py rounds the same way). */
static void quantize_row(const void *x, int bf16, int k, int8_t *x8, float *xd,
                         int32_t *s) {
    for (int g = 0; g < k / GROUP; g++) {
        float v[GROUP];
        for (int i = 0; i < GROUP; i++) {
            int idx = g * GROUP + i;
            if (bf16) {
                uint32_t bits = (uint32_t)((const uint16_t *)x)[idx] << 16;
                memcpy(&v[i], &bits, 4);
            } else {
                v[i] = ((const float *)x)[idx];
            }
        }
        float amax = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            float a = v[i] < 0 ? -v[i] : v[i];
            amax = a > amax ? a : amax;
        }
        float d = amax / 127.0f;
        float inv = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) {
            float r = v[i] * inv;
            int q = (int)(r < 0 ? r - 0.5f : r + 0.5f);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            x8[g * GROUP + i] = (int8_t)q;
            sum += q;
        }
        xd[g] = d;
        s[g] = sum;
    }
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

/* One tile (16 rows) for `rows` activation rows (1..MAX_ROWS). */
static void tile_rows(const uint8_t *codes, const uint16_t *d16, const uint16_t *m16,
                      int groups, int rows, const int8_t *x8, const float *xd,
                      const int32_t *s, int k, float out[MAX_ROWS][TILE]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *block = codes + (size_t)g * (TILE * GROUP / 2);
        _mm_prefetch((const char *)(block + 8 * 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(block + 9 * 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(block + 10 * 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(block + 11 * 64), _MM_HINT_T0);
        __m512i dot[MAX_ROWS];
        for (int r = 0; r < MAX_ROWS; r++) dot[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512((const void *)(block + j * 64));
            __m512i lo = _mm512_and_si512(v, low);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            for (int r = 0; r < rows; r++) {
                const int8_t *xr = x8 + (size_t)r * k + g * GROUP + j * 8;
                int32_t a, b;
                memcpy(&a, xr, 4);
                memcpy(&b, xr + 4, 4);
                dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(a));
                dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(b));
            }
        }
        __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(d16 + g * TILE)));
        if (m16) {
            __m512 mv = _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(m16 + g * TILE)));
            for (int r = 0; r < rows; r++) {
                float xs = xd[r * (k / GROUP) + g];
                __m512 sum = _mm512_cvtepi32_ps(dot[r]);
                acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dv, _mm512_set1_ps(xs)), acc[r]);
                acc[r] = _mm512_fmadd_ps(
                    mv, _mm512_set1_ps(xs * (float)s[r * (k / GROUP) + g]), acc[r]);
            }
        } else {
            for (int r = 0; r < rows; r++) {
                float xs = xd[r * (k / GROUP) + g];
                __m512i centred = _mm512_sub_epi32(
                    dot[r], _mm512_set1_epi32(8 * s[r * (k / GROUP) + g]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred),
                                         _mm512_mul_ps(dv, _mm512_set1_ps(xs)), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], acc[r]);
}

/* y [m, n] (float32 or bf16) = x [m, k] (float32 or bf16) times the tiled int4 weight
 * [n, k]; n a multiple of 16, k of 32. `work`: m * (k + 8 k / 32) bytes of scratch;
 * `threads`: PyTorch's count (its pool's, which the caller's thread may not have set for
 * OpenMP). Returns 0, or -1 for a shape it does not take. */
int int4_vnni_mm(const void *x, int x_bf16, int m, int k, const uint8_t *codes,
                 const uint16_t *d16, const uint16_t *m16, int n, void *y, int y_bf16,
                 void *work, int threads) {
    if (n % TILE || k % GROUP || m < 1) return -1;
    int groups = k / GROUP;
    int8_t *x8 = (int8_t *)work;
    float *xd = (float *)(x8 + (size_t)m * k);
    int32_t *s = (int32_t *)(xd + (size_t)m * groups);
    for (int r = 0; r < m; r++)
        quantize_row((const char *)x + (size_t)r * k * (x_bf16 ? 2 : 4), x_bf16, k,
                     x8 + (size_t)r * k, xd + (size_t)r * groups, s + (size_t)r * groups);
    int tiles = n / TILE;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int t = 0; t < tiles; t++) {
        const uint8_t *tc = codes + (size_t)t * groups * (TILE * GROUP / 2);
        const uint16_t *td = d16 + (size_t)t * groups * TILE;
        const uint16_t *tm = m16 ? m16 + (size_t)t * groups * TILE : 0;
        for (int r0 = 0; r0 < m; r0 += MAX_ROWS) {
            int rows = m - r0 < MAX_ROWS ? m - r0 : MAX_ROWS;
            float out[MAX_ROWS][TILE];
            tile_rows(tc, td, tm, groups, rows, x8 + (size_t)r0 * k, xd + (size_t)r0 * groups,
                      s + (size_t)r0 * groups, k, out);
            for (int r = 0; r < rows; r++) {
                size_t base = (size_t)(r0 + r) * n + (size_t)t * TILE;
                if (y_bf16)
                    for (int i = 0; i < TILE; i++) ((uint16_t *)y)[base + i] = to_bf16(out[r][i]);
                else
                    memcpy((float *)y + base, out[r], sizeof(out[r]));
            }
        }
    }
    return 0;
}
