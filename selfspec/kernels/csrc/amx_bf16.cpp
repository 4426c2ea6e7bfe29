// bf16 weights x bf16 activations on AMX tiles: our loop's full-model products on a CPU with AMX
// (selfspec/kernels/amx.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] for bf16 x [M, K] and a bf16 weight laid out in VNNI panels of 16
// outputs: w [P, Kp/2, 16, 2], P = ceil(N / 16), Kp = K rounded up to 32, element [p, k/2, j, k % 2] = w[16p + j, k]
// (zeros past N and K). One tile product (_tile_dpbf16ps) takes 32 inputs of up to 16 rows against a 1 KiB block of
// a panel (32 inputs x 16 outputs); a pass takes 4 panels side by side in four accumulator tiles, so each block of
// x is loaded once for 64 outputs, and each panel is read once per call for all rows. The products of bf16 values are
// exact in fp32 and the sums run in fp32, rounded once to bf16 at the end.
//
// Row-invariant: a row's result depends only on the row (the tile product computes each accumulator row from its own
// row of x), and every row takes the same blocks in the same order whatever the call's row count: a row computes the
// same bits in a one-row step as in a verify (docs/numerics.md). Calls of more than 16 rows take them 16 at a time
// over each group of panels, which then stays in L2 for the later row blocks.
//
// Reading the weights is what bounds a step. The tile loads stream four panels at a time and every line of a block
// 4 KiB ahead is prefetched into L1 (docs/kernels.md has what it reads against our fp16 panels). The tile products
// themselves are a few percent of a one-row step, so a verify of up to 16 rows costs about what a one-row step does.
//
// Linux hands out AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, once a process): permitted()
// asks, and the Python side uses the kernel only where it was granted.
//
// Built without AMX (-mavx512bf16, a CPU with AVX-512 BF16 and no tiles, e.g. a Zen 4), the same panels run on
// AVX-512's bf16 dot product (_mm512_dpbf16_ps: a pair of inputs for 16 outputs an instruction): one accumulator a
// row and 16 outputs, summed over the input pairs in order from zero, so a row's bits again do not depend on the
// other rows of the call. A pass holds up to 4 panels x 6 rows (or 2 x 12, 1 x 12) of accumulators in registers and
// loads each line of a panel once for all of them.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cstring>

namespace {
constexpr int64_t KB = 32;          // inputs per tile product
constexpr int64_t BLOCK = KB * 16;  // bf16 values in a panel's block (1 KiB)
constexpr int PANELS = 4;           // panels a pass, one accumulator tile each (tiles 0-3; x in 4, the blocks in 5-7)
constexpr int ROWS = 16;            // rows a tile holds
constexpr int PF_AHEAD = 4096;      // every line of a block this far ahead is prefetched (1 KiB ahead read slower)

#ifdef __AMX_TILE__
struct alignas(64) TileConfig {
  uint8_t palette, start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

void configure(int rows) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = rows, cfg.colsb[t] = 64;  // accumulators and x: `rows` rows
  for (int t = 5; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;    // a block: 16 pairs of inputs x 16 outputs
  _tile_loadconfig(&cfg);
}

// c [rows, 64] (a row's 16 NP floats at c + 64 m) = x [rows, Kp] against NP panels (panel q at w + q * pstride)
template <int NP>
void pass(const uint16_t* x, int64_t kp, const uint16_t* w, int64_t pstride, float* c) {
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (NP > 2) _tile_zero(2);
  if constexpr (NP > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < kp / KB; ++kb) {
    const uint16_t* b = w + kb * BLOCK;
    for (int q = 0; q < NP; ++q) {
      const char* ahead = reinterpret_cast<const char*>(b + q * pstride) + PF_AHEAD;
      for (int line = 0; line < 1024; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    _tile_loadd(4, x + kb * KB, kp * 2);
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NP > 1) {
      _tile_loadd(6, b + pstride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (NP > 2) {
      _tile_loadd(7, b + 2 * pstride, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if constexpr (NP > 3) {
      _tile_loadd(5, b + 3 * pstride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, 256);
  if constexpr (NP > 1) _tile_stored(1, c + 16, 256);
  if constexpr (NP > 2) _tile_stored(2, c + 32, 256);
  if constexpr (NP > 3) _tile_stored(3, c + 48, 256);
}

#else
bool permitted() { return true; }  // the dot-product build needs no tile state

// c [R, NP * 16] (row m's outputs at c + m * ldc) = x [R, Kp] against NP panels (panel q at w + q * pstride):
// one accumulator a row and 16 outputs, the input pairs in order
template <int NP, int R>
void dot_pass(const uint16_t* x, int64_t kp, const uint16_t* w, int64_t pstride, float* c, int64_t ldc) {
  __m512 acc[NP][R];
  for (int q = 0; q < NP; ++q)
    for (int m = 0; m < R; ++m) acc[q][m] = _mm512_setzero_ps();
  const int64_t pairs = kp / 2;
  const int32_t* xi = reinterpret_cast<const int32_t*>(x);
  for (int64_t kk = 0; kk < pairs; ++kk) {
    __m512bh wv[NP];
    for (int q = 0; q < NP; ++q) {
      const uint16_t* line = w + q * pstride + kk * 32;
      _mm_prefetch(reinterpret_cast<const char*>(line) + PF_AHEAD, _MM_HINT_T0);
      wv[q] = (__m512bh)_mm512_loadu_si512(line);
    }
    for (int m = 0; m < R; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xi[m * pairs + kk]);
      for (int q = 0; q < NP; ++q) acc[q][m] = _mm512_dpbf16_ps(acc[q][m], wv[q], xv);
    }
  }
  for (int m = 0; m < R; ++m)
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + m * ldc + q * 16, acc[q][m]);
}

using DotPass = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t);

template <int NP, int... Rs>
constexpr std::array<DotPass, sizeof...(Rs)> dot_table(std::integer_sequence<int, Rs...>) {
  return {&dot_pass<NP, Rs + 1>...};
}
constexpr auto DOT4 = dot_table<4>(std::make_integer_sequence<int, 6>{});   // 4 panels, 1-6 rows
constexpr auto DOT2 = dot_table<2>(std::make_integer_sequence<int, 12>{});  // 2 panels, 1-12 rows
constexpr auto DOT1 = dot_table<1>(std::make_integer_sequence<int, 12>{});  // a last panel, 1-12 rows
#endif

at::Tensor amx_mm(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, int64_t n_out) {
  TORCH_CHECK(permitted(), "amx_mm: this process may not use AMX tiles (arch_prctl refused)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "amx_mm: x bf16 [M, K]");
  TORCH_CHECK(w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 && w.scalar_type() == at::kBFloat16 &&
                  w.is_contiguous(), "amx_mm: w bf16 [P, Kp/2, 16, 2], contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), kp = w.size(1) * 2;
  TORCH_CHECK(kp % KB == 0 && K <= kp && kp - K < KB, "amx_mm: w's inputs are x's rounded up to 32");
  TORCH_CHECK(n_out <= P * 16 && n_out > (P - 1) * 16, "amx_mm: n_out does not fit w's panels");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() &&
                                    bias->numel() == n_out), "amx_mm: bias fp32 [n_out]");
  // x with its inputs padded to kp by zeros (exact: a zero adds nothing to any sum)
  const at::Tensor xp = K == kp ? x.contiguous() : at::constant_pad_nd(x, {0, kp - K}, 0).contiguous();
  at::Tensor out = at::empty({M, n_out}, x.options());
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xp.data_ptr());
  const uint16_t* ws = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t pstride = kp * 16;
#ifdef __AMX_TILE__
  const int64_t per_pass = PANELS, row_block = ROWS;
#else
  const int64_t per_pass = M <= 6 ? 4 : 2, row_block = M <= 6 ? 6 : 12;
#endif
  const int64_t groups = (P + per_pass - 1) / per_pass;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float c[ROWS * 64];
#ifdef __AMX_TILE__
    int configured = 0;
#endif
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p = g * per_pass, np = std::min<int64_t>(per_pass, P - p);
      const int64_t n0 = p * 16, nn = std::min<int64_t>(np * 16, n_out - n0);
      for (int64_t m0 = 0; m0 < M; m0 += row_block) {
        const int rows = static_cast<int>(std::min<int64_t>(row_block, M - m0));
        const uint16_t* xr = xs + m0 * kp;
        const uint16_t* wp = ws + p * pstride;
#ifdef __AMX_TILE__
        if (rows != configured) configure(configured = rows);
        switch (np) {
          case 4: pass<4>(xr, kp, wp, pstride, c); break;
          case 3: pass<3>(xr, kp, wp, pstride, c); break;
          case 2: pass<2>(xr, kp, wp, pstride, c); break;
          default: pass<1>(xr, kp, wp, pstride, c);
        }
        const int64_t stride = 64;
#else
        const int64_t stride = np * 16;
        if (np == per_pass)
          (per_pass == 4 ? DOT4[rows - 1] : DOT2[rows - 1])(xr, kp, wp, pstride, c, stride);
        else  // the last panels of a weight whose panels do not fill a pass: one at a time
          for (int64_t q = 0; q < np; ++q) DOT1[rows - 1](xr, kp, wp + q * pstride, pstride, c + q * 16, stride);
#endif
        for (int m = 0; m < rows; ++m)
          for (int64_t j = 0; j < nn; ++j)
            op[(m0 + m) * n_out + n0 + j] = c10::BFloat16(c[m * stride + j] + (bp ? bp[n0 + j] : 0.f));
      }
    }
#ifdef __AMX_TILE__
    if (configured) _tile_release();
#endif
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(selfspec_amx, m) {
  m.def("amx_mm(Tensor x, Tensor w, Tensor? bias, int n_out) -> Tensor");
  m.def("permitted() -> bool");
}
TORCH_LIBRARY_IMPL(selfspec_amx, CPU, m) { m.impl("amx_mm", &amx_mm); }
TORCH_LIBRARY_IMPL(selfspec_amx, CatchAll, m) { m.impl("permitted", &permitted); }
