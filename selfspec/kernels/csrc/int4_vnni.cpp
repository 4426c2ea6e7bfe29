// int4 weights x int8 activations: the draft's int4 products (selfspec/kernels/vnni.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] for bf16 x [M, K] and int4 w, where w = (q - 8) * scale + zero per group of G
// inputs (the values torch's _weight_int4pack_mm_for_cpu computes with). x is rounded to int8 with one scale per
// block of ACT_BLOCK (128) inputs, the same bytes on both builds; the integer products run on AVX-512 VNNI's
// _mm512_dpbusd_epi32 (4 u8 x s8 products per lane) where the build targets it (__AVX512VNNI__), else on AVX2's
// _mm256_maddubs_epi16 + _mm256_madd_epi16 (sums of 4 products per lane: a pair of products, at most 2 * 15 * 127,
// fits in int16). The two builds sum the floats in different orders, so their outputs may differ in the last bits.
//
// Layout of w: [N, K/2] uint8; each 64 bytes hold 128 inputs, byte j = q[j] | q[j + 64] << 4.
// Layout of sz: [N, K/G, 2] bf16 (scale, zero). K % 128 == 0, G in {32, 64, 128, 256}, G | K.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "int4_vnni.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

// Inputs per activation scale: 128, the inputs of 64 packed bytes, so that their integer sums meet before one
// conversion and one multiply-add where blocks of 64 take two of each (groups of 128 and 256: rows_block_wide); on
// AVX2 the four vpmaddubsw sums meet in int16 and take one vpmaddwd, on AVX-512 the two vpdpbusd sums meet in int32.
constexpr int64_t ACT_BLOCK = 128;

// packed bytes read ahead of the chunk in use: the rows are contiguous, so it runs on into the next rows (2 KiB took
// the AVX2 build's one-row product from ~22 to ~29 G weights/s on a Zen 3; with one load per chunk, the AVX-512
// build's MLP products inside a draft step from ~38 to ~50 on a Zen 4, scripts/profile_draft_step.py, docs/log.md)
constexpr int64_t PREFETCH_BYTES = 2048;
// and, on AVX-512, a second prefetch into L2 this far ahead: on a 2-core Xeon with AMX the one-row product of the 1.5B's
// MLP shapes then read 0.84 of the memory's rate, against 0.66 before (scripts/roofline.py, docs/kernels.md)
constexpr int64_t PREFETCH_L2_BYTES = 16384;

#if defined(__AVX512VNNI__)
#include "int4_avx512.h"
#else
#include "int4_avx2.h"
#endif

// the largest magnitude of n inputs (n a multiple of VW), on either build's vectors
inline float block_amax(const at::BFloat16* x, int64_t n) {
  vf top = zero();
  for (int64_t j = 0; j < n; j += VW) top = vmax(top, vabs(load_bf16(x + j)));
  return hmax(top);
}

// Per row m: xq int8 [M, K], xs [M, K/64] each block of 64's scale (the same for the two of a block of 128), xg
// [M, K/G] each group's sum of the *rounded* activations (xs * xq), so that the zero point's term and the integer
// products see the same inputs.
void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xs, float* xg) {
  const int64_t blocks = K / 64;
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sum[2];  // of each 32 inputs
      const at::BFloat16* xb = x + m * K + b * 64;
      if (b % (ACT_BLOCK / 64) == 0) amax = block_amax(xb, ACT_BLOCK);  // the first block of 64 of each ACT_BLOCK
      quantize_block(xb, xq + m * K + b * 64, sum, amax > 0.f ? 127.f / amax : 0.f);
      const float scale = amax / 127.f;
      xs[m * blocks + b] = scale;
      for (int j = 0; j < 2; ++j) {
        const int64_t k0 = b * 64 + j * 32, g = k0 / G;
        if (k0 % G == 0) xg[m * (K / G) + g] = 0.f;
        xg[m * (K / G) + g] += scale * static_cast<float>(sum[j]);
      }
    }
  }
}

// Calls f with the row count 1..4 as a compile-time constant (the kernels keep one accumulator per row in registers).
template <typename F>
void by_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{});
  }
}

}  // namespace

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t G) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "w: contiguous uint8 [N, K/2]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 128 == 0 && (G == 32 || G % 64 == 0) && K % G == 0 && w.size(1) == K / 2,
              "K % 128, G 32 or a multiple of 64, K % G, w [N, K/2]");
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.numel() == N * (K / G) * 2,
              "sz: contiguous bf16 [N, K/G, 2]");
  auto xq = at::empty({M, K}, at::kChar);
  auto xs = at::empty({M, K / 64}, at::kFloat);
  auto xg = at::empty({M, K / G}, at::kFloat);
  quantize_rows(x.data_ptr<at::BFloat16>(), M, K, G, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xg.data_ptr<float>());
  auto y = at::empty({M, N}, at::kBFloat16);
  const uint8_t* W = w.data_ptr<uint8_t>();
  const at::BFloat16* SZ = sz.data_ptr<at::BFloat16>();
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* XS = xs.data_ptr<float>();
  const float* XG = xg.data_ptr<float>();
  // groups of 128 and 256 (and of 32 on AVX2): each group's (-8 a, a), for the zero points' term as one dot product
  // a row
#if defined(__AVX512VNNI__)
  const bool pairs = G % 128 == 0;
#else
  const bool pairs = G == 32 || G % 128 == 0;
#endif
  auto xz = at::empty({M, pairs ? 2 * (K / G) : 0}, at::kFloat);
  if (pairs) {
    float* z = xz.data_ptr<float>();
    for (int64_t j = 0; j < M * (K / G); ++j) z[2 * j] = -8.f * XG[j], z[2 * j + 1] = XG[j];
  }
  const float* XZ = pairs ? xz.data_ptr<float>() : XG;
  at::BFloat16* Y = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      by_rows(std::min<int64_t>(4, M - m0), [&](auto rows) {
        constexpr int MB = decltype(rows)::value;
        if (G == 32) rows_block_g32<MB>(W, SZ, XQ, XS, XZ, Y, K, N, m0, n0, n1);
        else if (G % 128 == 0) rows_block_wide<MB>(W, SZ, XQ, XS, XZ, Y, K, N, G, m0, n0, n1);
        else rows_block<MB>(W, SZ, XQ, XS, XG, Y, K, N, G, m0, n0, n1);
      });
    }
  });
  return y;
}

// Torch operators (torch.ops.selfspec_vnni.*), so that the profiler and the dispatcher see them like torch's own;
// the fused draft calls (draft_fused.cpp) and the row attention (row_attention.cpp) add theirs to the namespace.
TORCH_LIBRARY(selfspec_vnni, m) { m.def("int4_mm(Tensor x, Tensor w, Tensor sz, int group_size) -> Tensor"); }
TORCH_LIBRARY_IMPL(selfspec_vnni, CPU, m) { m.impl("int4_mm", &int4_mm); }
