// fp16 weights x fp32 activations for the verify's few rows: our loop's packed products on AVX2 (selfspec/kernels/fp16.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] for x [M, K] (bf16 or fp32) and the exact fp16 copy of a bf16 weight,
// laid out in panels of 16 outputs: w [P, K, 16] fp16, P = ceil(N / 16), panel p holding outputs 16p..16p+15 for each
// input k (zeros past N). A weight that fp16 does not hold exactly keeps its bf16 values in the same panels (w bf16),
// widened to fp32 by a shift: the same fp32 weights, so the same products in the same order. The products run in
// fp32 on AVX2 + FMA + F16C: each 16-output panel is read once per call for all M rows (up to ROW_CHUNK of them), in
// blocks of up to 6 rows x 16 outputs (twelve ymm accumulators, each weight widened once per block), the panel's
// blocks of 256 inputs kept in L1 across the row blocks. Up to 6 rows thus take one pass over the weights, their FMAs
// running under the reading: on a 2-core Zen 3 a 6-row product costs about 1.3 one-row products (docs/kernels.md).
// fbgemm's fp16 kernel, which this replaces on such CPUs, handles 6 rows at a time and reads every weight again for
// each further 6 (docs/log.md). The sums run in fp32 in another order than fbgemm's: the same numbers up to rounding,
// rounded once to the output's dtype.
//
// Where the CPU has AVX-512 F the same file builds with 512-bit vectors (blocks of up to 12 rows, the same bits): it
// runs the full model on a CPU with AMX, and wherever a model is packed as fp16 on purpose (SELFSPEC_PACK=fp16,
// selfspec.kernels.packed.weight_packer's kind); other AVX-512 CPUs keep oneDNN's bf16 products.
//
// Row-invariant: every row's sum runs in the same order whatever the call's row count or the row's place in it (one
// chain of FMAs per output over the inputs, block after block), so a row computes the same bits in a one-row step as
// in a verify (docs/numerics.md). One chain leaves a single row waiting on the FMA's latency, which still runs well
// under the weights' reading; two interleaved chains per output (revisions 2 and 3) fitted only 3 rows in the
// registers, so a 6-row product passed over each block twice and cost about 1.7 one-row products.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {
constexpr int64_t KC = 256;        // inputs per block: a panel's block (8 KiB) stays in L1 across the row blocks
constexpr int PF_AHEAD = 4096;     // software prefetch distance in a panel (bytes; 2048 read a little slower)
constexpr int PF_L2 = 16384;       // AVX-512: a second prefetch, into L2, this far ahead (as the int4 kernel's)

#if defined(__AVX512F__)
// The AVX-512 build (selfspec/kernels/fp16.py builds it where the CPU has AVX-512 F): a panel's 16 outputs are one
// zmm register, so a block takes up to 12 rows, one accumulator each, and a pass takes two panels where the thread
// has two left; the same single FMA chain per output over the inputs, so the same bits as the AVX2 build,
// row for row, whatever the pairing.
template <bool BF16>
inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}
// c[m, 0:16 NP] (+)= sum over kc inputs of x[m, k] * w_q[k, 0:16] for MR <= 12 rows and NP panels side by side
// (panel q at w + q * pstride; c holds their tiles side by side, 16 NP floats a row): MR x NP accumulators, one FMA
// chain each. Two panels a pass let each row's broadcast input feed two FMAs, so 12 rows take 14 loads for 24 FMAs
// where one panel takes 13 for 12; one panel serves a thread's last odd panel.
template <int NP, int MR, bool PF, bool BF16>
inline void micro(const float* x, int64_t ldx, const uint16_t* w, int64_t pstride, int64_t kc, float* c,
                  bool load_c) {
  __m512 acc[MR][NP];
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < NP; ++q)
      acc[m][q] = load_c ? _mm512_loadu_ps(c + (m * NP + q) * 16) : _mm512_setzero_ps();
  const auto input = [&](int64_t k) __attribute__((always_inline)) {
    __m512 wq[NP];
    for (int q = 0; q < NP; ++q) wq[q] = widen16<BF16>(w + q * pstride + k * 16);
#pragma GCC unroll 12
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
      for (int q = 0; q < NP; ++q) acc[m][q] = _mm512_fmadd_ps(xb, wq[q], acc[m][q]);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= kc; k += 2) {
    if constexpr (PF) {
      for (int q = 0; q < NP; ++q)
        _mm_prefetch(reinterpret_cast<const char*>(w + q * pstride + k * 16) + PF_AHEAD, _MM_HINT_T0);
      for (int q = 0; q < NP; ++q)
        _mm_prefetch(reinterpret_cast<const char*>(w + q * pstride + k * 16) + PF_L2, _MM_HINT_T1);
    }
    input(k);
    input(k + 1);
  }
  if (k < kc) input(k);
#pragma GCC unroll 12
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + (m * NP + q) * 16, acc[m][q]);
}
constexpr int64_t MR_MAX = 12;  // rows per block: 12 x 2 accumulators, two weights and a broadcast in 32 zmm registers

#else  // AVX2
// 8 weights of a panel row as fp32: fp16 (F16C) or bf16 (a shift of 16 bits), exact either way
template <bool BF16>
inline __m256 widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

// c[m, 0:16] (+)= sum over kc inputs of x[m, k] * w[k, 0:16] for MR <= 6 rows, in registers: MR x 2 accumulators,
// one FMA chain each over consecutive inputs. The accumulators start from c (load_c) instead of being added to it at
// the end: a branch there made GCC keep them on the stack (half the speed). PF: prefetch the panel ahead (the first
// row block of a panel's pass only). BF16: the panel holds bf16 weights (else fp16).
template <int MR, bool PF, bool BF16>
inline void micro(const float* x, int64_t ldx, const uint16_t* w, int64_t kc, float* c, bool load_c) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = load_c ? _mm256_loadu_ps(c + m * 16) : _mm256_setzero_ps();
    acc[m][1] = load_c ? _mm256_loadu_ps(c + m * 16 + 8) : _mm256_setzero_ps();
  }
  const auto input = [&](int64_t k) __attribute__((always_inline)) {  // every row's FMAs for input k
    const __m256 w0 = widen<BF16>(w + k * 16), w1 = widen<BF16>(w + k * 16 + 8);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  };
  int64_t k = 0;
  for (; k + 2 <= kc; k += 2) {  // two inputs an iteration: one 64-byte line of the panel
    if constexpr (PF) _mm_prefetch(reinterpret_cast<const char*>(w + k * 16) + PF_AHEAD, _MM_HINT_T0);
    input(k);
    input(k + 1);
  }
  if (k < kc) input(k);  // an odd input count's last input
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(c + m * 16, acc[m][0]);
    _mm256_storeu_ps(c + m * 16 + 8, acc[m][1]);
  }
}

constexpr int64_t MR_MAX = 6;  // rows per block: 6 x 2 = 12 accumulators, 2 weights and a broadcast in 16 ymm registers
// A call over this many rows runs in calls of at most this many (AVX2 build): a panel's pass reads the rows' inputs
// of each block again for every panel, and a block of 128 rows' (128 KiB) stays in L2 where a long prompt's does not.
// A 900-row product of the 1.5B's MLP shapes ran 1.12-1.28x as fast so on a 2-core Zen 3 (docs/kernels.md).
constexpr int64_t ROW_CHUNK = 128;


#endif  // AVX-512 or AVX2

// Calls f with the row count mr (1..MR_MAX; more: MR_MAX) as a compile-time constant.
template <int R = 1, typename F>
inline void with_rows(int64_t mr, F&& f) {
  if constexpr (R == MR_MAX) f(std::integral_constant<int, R>{});
  else if (mr == R) f(std::integral_constant<int, R>{});
  else with_rows<R + 1>(mr, std::forward<F>(f));
}

// x [M, K] bf16 or fp32, w [P, K, 16] fp16 (or bf16) panels, bias fp32 [n_out] or none -> [M, n_out] in x's dtype.
// The threads split the panels; each computes a panel's M x 16 outputs (two panels' M x 32 on AVX-512) in fp32 (a
// tile) and rounds them once.
at::Tensor fp16_mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == 16 && w.is_contiguous() &&
              (w.scalar_type() == at::kHalf || w.scalar_type() == at::kBFloat16),
              "fp16_mm: x [M, K] and w [P, K, 16] fp16 or bf16, contiguous");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == n_out), "fp16_mm: bias fp32 [n_out]");
#if !defined(__AVX512F__)
  if (x.size(0) > ROW_CHUNK) {  // a prefill's rows, ROW_CHUNK at a time (each row's sums are the same either way)
    at::Tensor out = at::empty({x.size(0), n_out}, x.options());
    for (int64_t m0 = 0; m0 < x.size(0); m0 += ROW_CHUNK) {
      const int64_t len = std::min<int64_t>(ROW_CHUNK, x.size(0) - m0);
      out.narrow(0, m0, len).copy_(fp16_mm(x.narrow(0, m0, len), w, bias, n_out));
    }
    return out;
  }
#endif
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const int64_t M = x32.size(0), K = x32.size(1), P = w.size(0);
  TORCH_CHECK(w.size(1) == K && n_out <= P * 16 && n_out > (P - 1) * 16, "fp16_mm: w's shape does not fit x and n_out");
  at::Tensor out = at::empty({M, n_out}, x.options());
  const float* xp = x32.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const bool wide_bf16 = w.scalar_type() == at::kBFloat16;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "fp16_mm: x bf16 or fp32");
  at::BFloat16* ob = bf16 ? out.data_ptr<at::BFloat16>() : nullptr;
  float* of = bf16 ? nullptr : out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> tile(M * 32);
    for (int64_t p = p0; p < p1;) {
#if defined(__AVX512F__)
      const int64_t np = p + 1 < p1 ? 2 : 1;  // panels this pass: two where the thread has two left
#else
      const int64_t np = 1;
#endif
      const int64_t stride = 16 * np;  // the tile's floats a row
      const uint16_t* wpan = wp + p * K * 16;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        for (int64_t m0 = 0; m0 < M; m0 += MR_MAX) {
          with_rows(std::min<int64_t>(MR_MAX, M - m0), [&](auto mr) {
            constexpr int R = decltype(mr)::value;
            const auto block = [&](auto bf16_panel) {  // the panel's weight type as a compile-time constant
              constexpr bool B = decltype(bf16_panel)::value;
              const float* xr = xp + m0 * K + k0;
              float* c = tile.data() + m0 * stride;
#if defined(__AVX512F__)
              const auto run = [&](auto panels) {  // the pass's panel count as a compile-time constant
                constexpr int NP = decltype(panels)::value;
                if (m0 == 0) micro<NP, R, true, B>(xr, K, wpan + k0 * 16, K * 16, kc, c, k0 > 0);
                else micro<NP, R, false, B>(xr, K, wpan + k0 * 16, K * 16, kc, c, k0 > 0);
              };
              if (np == 2) run(std::integral_constant<int, 2>{});
              else run(std::integral_constant<int, 1>{});
#else
              if (m0 == 0) micro<R, true, B>(xr, K, wpan + k0 * 16, kc, c, k0 > 0);
              else micro<R, false, B>(xr, K, wpan + k0 * 16, kc, c, k0 > 0);
#endif
            };
            if (wide_bf16) block(std::true_type{});
            else block(std::false_type{});
          });
        }
      }
      for (int64_t q = 0; q < np; ++q) {
        const int64_t n0 = (p + q) * 16, nn = std::min<int64_t>(16, n_out - n0);
        for (int64_t m = 0; m < M; ++m)
          for (int64_t j = 0; j < nn; ++j) {
            const float v = tile[m * stride + q * 16 + j] + (bp ? bp[n0 + j] : 0.f);
            if (ob) ob[m * n_out + n0 + j] = c10::BFloat16(v);
            else of[m * n_out + n0 + j] = v;
          }
      }
      p += np;
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(selfspec_fp16, m) { m.def("fp16_mm(Tensor x, Tensor w, Tensor? bias, int n_out) -> Tensor"); }
TORCH_LIBRARY_IMPL(selfspec_fp16, CPU, m) { m.impl("fp16_mm", &fp16_mm); }
