// Group-32 int4 and per-channel int8 weights times int8-quantised activations as PyTorch
// operators (`aici::int4_vnni_mm`, `aici::int8_vnni_mm`), which eager passes,
// torch.compile graphs and AOTInductor packages all call (int_mm.py); and, built with
// them, the eager passes' attention of one-token rows over their own slots
// (`aici::rows_attention`, native/rows_attention.c). "vnni" names the
// weights' layout (four consecutive bytes of a row per 32-bit lane, 16 rows a tile), which
// every instruction set's variant reads.
//
// The arithmetic is the torch-free core in native/ (int_dot.h: the layout, the rounding,
// the order of every float operation): one variant per instruction set, chosen when the
// library is built (AICI_VARIANT: avx512_vnni, avx_vnni, avx2, neon_dot, neon) and built
// with that variant's flags alone; this file adds what torch needs: checks, the output
// tensor, and threads (at::parallel_for over tiles, PyTorch's own pool).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "native/int_dot.h"
#include "native/rows_attention.h"

#define AICI_CAT2(a, b) a##b
#define AICI_CAT(a, b) AICI_CAT2(a, b)
#define INT4_TILES AICI_CAT(aici_int4_tiles_, AICI_VARIANT)
#define INT8_TILES AICI_CAT(aici_int8_tiles_, AICI_VARIANT)
// The activation quantiser: AVX2's on x86 (every x86 variant's CPU has it; int_mm.py
// links x86_quantise.c and defines AICI_QUANTISE_AVX2), elsewhere the generic one. Both
// give the same bytes.
#ifdef AICI_QUANTISE_AVX2
#define QUANTISE_F32 aici_quantise_f32_avx2
#define QUANTISE_BF16 aici_quantise_bf16_avx2
#else
#define QUANTISE_F32 aici_quantise_f32
#define QUANTISE_BF16 aici_quantise_bf16
#endif

namespace {

struct Quantised {
  std::vector<int8_t> x8;  // [rows, k]
  std::vector<float> xd;   // [rows, k / 32]
  std::vector<int32_t> s;  // [rows, k / 32]
  aici_acts acts;
};

// Rows quantised on one thread before the tiles' threads start (below it the fork costs
// more than the work): 16 K elements, ~6 us with AVX2.
constexpr int64_t QUANTISE_GRAIN = 16384;

// x [rows, k] quantised per group of 32 (int_dot.h), once a call: ~0.35 ns an element
// (AVX2; ~1 ns generic), the rows split over threads where there are many (a prompt's
// pass: a 1,500-token one quantised 225 M activations on one thread, 0.2 s of 2.4).
Quantised quantise(const at::Tensor& x) {
  Quantised q;
  int64_t rows = x.size(0), k = x.size(1), groups = k / AICI_GROUP;
  q.x8.resize(rows * k);
  q.xd.resize(rows * groups);
  q.s.resize(rows * groups);
  bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* data = bf16 ? static_cast<const void*>(x.data_ptr<at::BFloat16>())
                          : static_cast<const void*>(x.data_ptr<float>());
  at::parallel_for(0, rows, std::max<int64_t>(1, QUANTISE_GRAIN / k), [&](int64_t r0, int64_t r1) {
    int8_t* x8 = q.x8.data() + r0 * k;
    float* xd = q.xd.data() + r0 * groups;
    int32_t* s = q.s.data() + r0 * groups;
    if (bf16)
      QUANTISE_BF16(static_cast<const uint16_t*>(data) + r0 * k, r1 - r0, k, x8, xd, s);
    else
      QUANTISE_F32(static_cast<const float*>(data) + r0 * k, r1 - r0, k, x8, xd, s);
  });
  q.acts = aici_acts{q.x8.data(), q.xd.data(), q.s.data(), rows, k};
  return q;
}

void check_input(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.size(1) % AICI_GROUP == 0 && x.is_contiguous(),
              "aici int kernels: x must be a contiguous [rows, k] matrix, k a multiple of 32");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "aici int kernels: x must be bfloat16 or float32");
}

// [rows, n] in x's dtype: the tiles split over threads, each writing its own columns of
// a float32 result (the core's output), rounded to bf16 at the end where x is bf16.
template <typename Tiles>
at::Tensor run_tiles(const at::Tensor& x, int64_t n, Tiles tiles) {
  int64_t rows = x.size(0);
  TORCH_CHECK(n % AICI_TILE == 0, "aici int kernels: n must be a multiple of 16");
  at::Tensor y = at::empty({rows, n}, x.options().dtype(at::kFloat));
  if (rows == 0) return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
  Quantised q = quantise(x);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, n / AICI_TILE, 1, [&](int64_t begin, int64_t end) {
    tiles(&q.acts, begin, end, out);
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

at::Tensor int4_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                        const at::Tensor& m, int64_t n) {
  int64_t k = x.size(1), groups = k / AICI_GROUP;
  check_input(x, k);
  TORCH_CHECK(codes.numel() == n * k / 2 && d.numel() == n * groups &&
                  (m.numel() == 0 || m.numel() == n * groups),
              "aici::int4_vnni_mm: codes, d or m do not fit an [n, k] matrix");
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = m.numel() ? reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>()) : nullptr;
  return run_tiles(x, n, [&](const aici_acts* acts, int64_t begin, int64_t end, float* out) {
    INT4_TILES(cp, dp, mp, acts, n, begin, end, out);
  });
}

at::Tensor int8_vnni_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        int64_t n) {
  int64_t k = x.size(1);
  check_input(x, k);
  TORCH_CHECK(codes.numel() == n * k && scale.numel() == n && scale.scalar_type() == at::kFloat,
              "aici::int8_vnni_mm: codes or scale do not fit an [n, k] matrix");
  const auto* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  return run_tiles(x, n, [&](const aici_acts* acts, int64_t begin, int64_t end, float* out) {
    INT8_TILES(cp, sp, acts, n, begin, end, out);
  });
}

// q [S, G, R, D], k and v [>= S, G, >= max(lengths), D], all float32 or all bf16 (views:
// any strides but D's), lengths [S] int64: each row's attention over its own first
// lengths[s] slots (native/rows_attention.c), [S, G, R, D] in q's dtype; the (row, head)
// pairs split over threads. The arithmetic is float32 either way: a bf16 output is the
// float32 result rounded once (to nearest even, as a torch cast rounds).
at::Tensor rows_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && lengths.dim() == 1,
              "aici::rows_attention: q, k, v [rows, kv_heads, ., D] and lengths [rows]");
  int64_t S = q.size(0), G = q.size(1), R = q.size(2), D = q.size(3);
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype && lengths.scalar_type() == at::kLong,
              "aici::rows_attention: q, k, v all float32 or all bf16, and int64 lengths");
  TORCH_CHECK(k.size(0) >= S && v.size(0) >= S && k.size(1) == G && v.size(1) == G &&
                  k.size(3) == D && v.size(3) == D && k.size(2) == v.size(2) &&
                  lengths.size(0) == S && R <= AICI_MAX_REP,
              "aici::rows_attention: q, k, v and lengths do not fit");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "aici::rows_attention: the head dimension must be contiguous");
  at::Tensor lens = lengths.contiguous();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t s = 0; s < S; s++) {
    TORCH_CHECK(lp[s] >= 0 && lp[s] <= k.size(2), "aici::rows_attention: a length past the cache");
    longest = std::max(longest, lp[s]);
  }
  at::Tensor out = at::empty({S, G, R, D}, q.options().dtype(at::kFloat));
  aici_attention_args args{q.data_ptr(), {q.stride(0), q.stride(1), q.stride(2)},
                           k.data_ptr(), {k.stride(0), k.stride(1), k.stride(2)},
                           v.data_ptr(), {v.stride(0), v.stride(1), v.stride(2)},
                           lp, G, R, D, static_cast<float>(scale), out.data_ptr<float>(),
                           dtype == at::kBFloat16 ? AICI_ELEM_BF16 : AICI_ELEM_F32};
  at::parallel_for(0, S * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(std::max<int64_t>(1, R * longest)));
    aici_rows_attention(&args, begin, end, scores.data());
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}

// x [..., hidden], weight [hidden]: an RMSNorm over the last dimension as
// transformers' Llama-family norms and models/families/llama.py compute it, the same ATen
// calls in the same order (`offset`: Gemma's, scaled by 1 + weight in float32, then cast).
// One opaque call to a compiler: inductor would fuse the norm and sum its squares in an
// order of its own, and a compiled step's tokens would part from the eager passes'.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  at::Tensor hidden = x.to(at::kFloat);
  if (offset) {
    hidden = hidden.mul(hidden.pow(2).mean(-1, true).add(eps).rsqrt());
    return hidden.mul(weight.to(at::kFloat).add(1.0)).to(x.scalar_type());
  }
  at::Tensor variance = hidden.pow(2).mean(-1, true);
  hidden = hidden.mul(variance.add(eps).rsqrt());
  return weight.mul(hidden.to(x.scalar_type()));
}

// The shape and dtype alone, for tracing (symbolic sizes pass through empty_like).
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps, bool offset) {
  auto dtype = offset ? x.scalar_type() : c10::promoteTypes(weight.scalar_type(), x.scalar_type());
  return at::empty_like(x, x.options().dtype(dtype));
}

}  // namespace

TORCH_LIBRARY(aici, lib) {
  lib.def("int4_vnni_mm(Tensor x, Tensor codes, Tensor d, Tensor m, int n) -> Tensor");
  lib.def("int8_vnni_mm(Tensor x, Tensor codes, Tensor scale, int n) -> Tensor");
  lib.def("rows_attention(Tensor q, Tensor k, Tensor v, Tensor lengths, float scale) -> Tensor");
  lib.def("rms_norm(Tensor x, Tensor weight, float eps, bool offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(aici, CPU, lib) {
  lib.impl("int4_vnni_mm", &int4_vnni_mm);
  lib.impl("int8_vnni_mm", &int8_vnni_mm);
  lib.impl("rows_attention", &rows_attention);
  lib.impl("rms_norm", &rms_norm);
}

TORCH_LIBRARY_IMPL(aici, Meta, lib) {
  lib.impl("rms_norm", &rms_norm_meta);
}
