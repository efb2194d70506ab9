// Group-32 int4 and per-channel int8 weights times int8-quantised activations on
// AVX512-VNNI, as PyTorch operators (`aici::int4_vnni_mm`, `aici::int8_vnni_mm`) that
// eager passes, torch.compile graphs and AOTInductor packages all call (int4_vnni.py).
//
// Activations are quantised per group of 32 inputs as x = xd x8 (x8 in -127..127,
// xd = amax / 127, as llama.cpp's Q8_0), with s = sum of the group's x8. Then
//
//   int4: y[m, n] = sum_g d[n,g] xd[m,g] dot4 + m[n,g] xd[m,g] s[m,g]
//         (weight = q d + m, q in 0..15; symmetric layers, m = -8 d, keep no m: their
//         term is folded into the integer sum as dot4 - 8 s);
//   int8: y[m, n] = scale[n] sum_g xd[m,g] (dot8 - 128 s[m,g])
//         (weight = c scale[n], c in -128..127 stored as c + 128, an unsigned byte).
//
// Layouts (`int4_vnni.tile`, `tile_int8`): rows in tiles of 16, each tile's groups in
// order. An int4 group is 4 sub-blocks of 64 bytes, byte 4 r + i of sub-block j holding
// row r's codes k = 8 j + i (low nibble) and 8 j + 4 + i (high nibble); an int8 group 8
// sub-blocks of 64 bytes, byte 4 r + i of sub-block j row r's k = 4 j + i. So one
// vpdpbusd adds four products of each of the 16 rows into its lane, the activations'
// four bytes broadcast, and a group's scales apply once for 16 rows. int4 scales:
// [tiles][groups][16] float16 d (and m).
//
// Per 512 int4 weights (a group of a tile): 4 loads of 64 bytes, 8 vpdpbusd, ~12 mask
// and shift ops, one convert and two FMAs: the step is bound by reading the weights, not
// by widening them (PyTorch's CPU int4 kernel widens every weight to float first).
// Threads: at::parallel_for over tiles (PyTorch's own pool and thread count).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 16;
constexpr int kGroup = 32;
constexpr int kMaxRows = 4;  // activation rows per pass over a tile's weights

struct Quantised {
  std::vector<int8_t> x8;  // [rows, k]
  std::vector<float> xd;   // [rows, k / 32]
  std::vector<int32_t> s;  // [rows, k / 32]
};

// Nearest, ties away from zero (int4_vnni.reference rounds the same way).
template <typename T>
Quantised quantise(const T* x, int64_t rows, int64_t k) {
  Quantised q;
  int64_t groups = k / kGroup;
  q.x8.resize(rows * k);
  q.xd.resize(rows * groups);
  q.s.resize(rows * groups);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t g = 0; g < groups; g++) {
      float v[kGroup];
      float amax = 0.0f;
      for (int i = 0; i < kGroup; i++) {
        v[i] = static_cast<float>(x[r * k + g * kGroup + i]);
        float a = v[i] < 0 ? -v[i] : v[i];
        amax = a > amax ? a : amax;
      }
      float d = amax / 127.0f;
      float inv = d != 0.0f ? 1.0f / d : 0.0f;
      int32_t sum = 0;
      for (int i = 0; i < kGroup; i++) {
        float t = v[i] * inv;
        int c = static_cast<int>(t < 0 ? t - 0.5f : t + 0.5f);
        c = c > 127 ? 127 : (c < -127 ? -127 : c);
        q.x8[r * k + g * kGroup + i] = static_cast<int8_t>(c);
        sum += c;
      }
      q.xd[r * groups + g] = d;
      q.s[r * groups + g] = sum;
    }
  }
  return q;
}

Quantised quantise(const at::Tensor& x) {
  if (x.scalar_type() == at::kBFloat16)
    return quantise(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1));
  return quantise(x.data_ptr<float>(), x.size(0), x.size(1));
}

inline int32_t four(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One int4 tile (16 output rows) for `rows` activation rows (1..kMaxRows).
void int4_tile(const uint8_t* codes, const uint16_t* d16, const uint16_t* m16, int64_t groups,
               int rows, const Quantised& q, int64_t r0, int64_t k, float out[][kTile]) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc[kMaxRows];
  for (int r = 0; r < kMaxRows; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* block = codes + g * (kTile * kGroup / 2);
    // Two groups ahead (8 lines): the stream of one tile is sequential, but the hardware
    // prefetcher alone left ~25% of the bandwidth unused here.
    for (int line = 8; line < 12; line++) _mm_prefetch(reinterpret_cast<const char*>(block + line * 64), _MM_HINT_T0);
    __m512i dot[kMaxRows];
    for (int r = 0; r < kMaxRows; r++) dot[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; j++) {
      __m512i v = _mm512_loadu_si512(block + j * 64);
      __m512i lo = _mm512_and_si512(v, low);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int r = 0; r < rows; r++) {
        const int8_t* xr = q.x8.data() + (r0 + r) * k + g * kGroup + j * 8;
        dot[r] = _mm512_dpbusd_epi32(dot[r], lo, _mm512_set1_epi32(four(xr)));
        dot[r] = _mm512_dpbusd_epi32(dot[r], hi, _mm512_set1_epi32(four(xr + 4)));
      }
    }
    __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d16 + g * kTile)));
    for (int r = 0; r < rows; r++) {
      int64_t at = (r0 + r) * groups + g;
      float xs = q.xd[at];
      if (m16) {
        __m512 mv = _mm512_cvtph_ps(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m16 + g * kTile)));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dv, _mm512_set1_ps(xs)), acc[r]);
        acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs * static_cast<float>(q.s[at])), acc[r]);
      } else {
        __m512i centred = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(8 * q.s[at]));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(dv, _mm512_set1_ps(xs)), acc[r]);
      }
    }
  }
  for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], acc[r]);
}

// One int8 tile (16 output rows): sum_g xd (dot - 128 s), before the rows' scales.
void int8_tile(const uint8_t* codes, int64_t groups, int rows, const Quantised& q, int64_t r0,
               int64_t k, float out[][kTile]) {
  __m512 acc[kMaxRows];
  for (int r = 0; r < kMaxRows; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const uint8_t* block = codes + g * (kTile * kGroup);
    for (int line = 8; line < 16; line++) _mm_prefetch(reinterpret_cast<const char*>(block + line * 64), _MM_HINT_T0);
    __m512i dot[kMaxRows];
    for (int r = 0; r < kMaxRows; r++) dot[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j++) {
      __m512i v = _mm512_loadu_si512(block + j * 64);
      for (int r = 0; r < rows; r++) {
        const int8_t* xr = q.x8.data() + (r0 + r) * k + g * kGroup + j * 4;
        dot[r] = _mm512_dpbusd_epi32(dot[r], v, _mm512_set1_epi32(four(xr)));
      }
    }
    for (int r = 0; r < rows; r++) {
      int64_t at = (r0 + r) * groups + g;
      __m512i centred = _mm512_sub_epi32(dot[r], _mm512_set1_epi32(128 * q.s[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(q.xd[at]), acc[r]);
    }
  }
  for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], acc[r]);
}

void check_input(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(1) % kGroup == 0 && x.is_contiguous(),
              "aici VNNI kernels: x must be a contiguous [rows, k] matrix, k a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "aici VNNI kernels: x must be bfloat16 or float32");
}

template <typename Tile>
at::Tensor run_tiles(const at::Tensor& x, int64_t n, Tile tile) {
  int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(n % kTile == 0, "aici VNNI kernels: n must be a multiple of 16");
  at::Tensor y = at::empty({rows, n}, x.options());
  if (rows == 0) return y;
  Quantised q = quantise(x);
  bool bf16 = x.scalar_type() == at::kBFloat16;
  at::parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    float out[kMaxRows][kTile];
    for (int64_t t = begin; t < end; t++) {
      for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
        int count = static_cast<int>(rows - r0 < kMaxRows ? rows - r0 : kMaxRows);
        tile(t, count, q, r0, k, out);
        for (int r = 0; r < count; r++) {
          int64_t base = (r0 + r) * n + t * kTile;
          if (bf16) {
            auto* yp = y.data_ptr<at::BFloat16>() + base;
            for (int i = 0; i < kTile; i++) yp[i] = at::BFloat16(out[r][i]);
          } else {
            std::memcpy(y.data_ptr<float>() + base, out[r], sizeof(out[r]));
          }
        }
      }
    }
  });
  return y;
}

at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                        const at::Tensor& m, int64_t n) {
  int64_t k = x.size(1), groups = k / kGroup;
  check_input(x, k);
  TORCH_CHECK(codes.numel() == n * k / 2 && d.numel() == n * groups &&
                  (m.numel() == 0 || m.numel() == n * groups),
              "aici::int4_vnni_mm: codes, d or m do not fit an [n, k] matrix");
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = m.numel() ? reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()) : nullptr;
  return run_tiles(x, n, [&](int64_t t, int rows, const Quantised& q, int64_t r0, int64_t kk,
                             float out[][kTile]) {
    int4_tile(cp + t * groups * (kTile * kGroup / 2), dp + t * groups * kTile,
              mp ? mp + t * groups * kTile : nullptr, groups, rows, q, r0, kk, out);
  });
}

at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        int64_t n) {
  int64_t k = x.size(1), groups = k / kGroup;
  check_input(x, k);
  TORCH_CHECK(codes.numel() == n * k && scale.numel() == n && scale.scalar_type() == at::kFloat,
              "aici::int8_vnni_mm: codes or scale do not fit an [n, k] matrix");
  const auto* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  return run_tiles(x, n, [&](int64_t t, int rows, const Quantised& q, int64_t r0, int64_t kk,
                             float out[][kTile]) {
    int8_tile(cp + t * groups * (kTile * kGroup), groups, rows, q, r0, kk, out);
    __m512 sv = _mm512_loadu_ps(sp + t * kTile);
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], _mm512_mul_ps(_mm512_loadu_ps(out[r]), sv));
  });
}

}  // namespace

TORCH_LIBRARY(aici, lib) {
  lib.def("int4_vnni_mm(Tensor x, Tensor codes, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("int8_vnni_mm(Tensor x, Tensor codes, Tensor scale, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(aici, CPU, lib) {
  lib.impl("int4_vnni_mm", &int4_vnni_mm);
  lib.impl("int8_vnni_mm", &int8_vnni_mm);
}
