// Row-invariant decode attention for bf16 full-model forwards (selfspec/engine/attention.py).
//
// Each query row attends its own keys in order and nothing else: its scores, its softmax and its sum over the values
// are computed by the same sequence of operations whatever the forward's other rows are, how many there are, where
// its keys sit in the cache, or how long the cache is. So a verify row computes bit for bit what a one-row step at
// its position computes (docs/numerics.md), by construction rather than by padding library products.
//
// q [H, R, D] bf16; k, v [KVH, L, D] bf16 (a view of the cache: the last two dimensions contiguous, the keys past a
// row's own never read); count int64 [R], row r's number of keys; index int64 [R, W] or none, the column of row r's
// t-th key (none: column t). Heads h = j * group + u share key/value head j. Out [R, H, D] bf16: softmax(q k^T *
// scale) v per row and head, in fp32 throughout (scores, exponentials, sums), rounded to bf16 once.
//
// Per (row, key/value head): the group's query heads read each key once (one fused multiply-add chain per head, so
// every head's sum runs over the head dimension in the same order as alone); max, exponentials and their total in
// key order; the values summed in key order, then times 1/total. The group's heads read each value once too: a
// pass over the keys loads a few vectors of each value and adds them into every head's sums (as many vectors as
// the heads' sums leave registers for), so each head's sum per element runs over the keys in the same order as alone.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "row_attention.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t HEADS = 8;  // query heads that read a key together (a larger group runs in blocks of this many)
// fp32 sums the values' pass keeps in registers (heads x vectors of the head dimension): 24 of AVX-512's 32
// registers, 12 of AVX2's 16, the rest for the values' vectors and a weight
constexpr int ACC = VW == 16 ? 24 : 12;

// p[0 .. n) <- exp(p - max p); returns their total. Whole vectors from the start, then the rest one by one; the
// total's lanes add in a fixed order, so it is a function of the row's scores alone.
float softmax_numerators(float* p, int64_t n) {
  float top = -INFINITY;
  for (int64_t t = 0; t < n; ++t) top = std::max(top, p[t]);
  const int64_t whole = n / VW * VW;
  vf sum = zero();
  for (int64_t t = 0; t < whole; t += VW) {
    const vf e = exp_neg(sub(loadu(p + t), set1(top)));
    storeu(p + t, e);
    sum = add(sum, e);
  }
  float total = hsum(sum);
  for (int64_t t = whole; t < n; ++t) {
    float buf[VW] = {};
    buf[0] = p[t] - top;
    storeu(buf, exp_neg(loadu(buf)));
    p[t] = buf[0];
    total += p[t];
  }
  return total;
}

// Key t's lanes of the NU heads' dot products: acc[u] = sum over i of k(t)[i] q_u[i], one chain of fused
// multiply-adds along the head dimension (hsum(acc[u]) is the score).
template <int NU>
inline void dot_lanes(const float* qf, const at::BFloat16* kt, int64_t D, vf* acc) {
  for (int u = 0; u < NU; ++u) acc[u] = zero();
  for (int64_t i = 0; i < D; i += VW) {
    const vf kv = load_bf16(kt + i);
    for (int u = 0; u < NU; ++u) acc[u] = fmadd(kv, loadu(qf + u * D + i), acc[u]);
  }
}

// Scores of NU query heads qf [NU, D] (fp32, scaled) against the keys at K + col(t) * D: p[u * n + t]. Whole
// blocks of VW keys add their lanes together (hsums, the same additions as hsum's), the rest one key at a time.
template <int NU>
void scores(const float* qf, const at::BFloat16* K, const int64_t* cols, int64_t n, int64_t D, float* p) {
  const int64_t whole = n / VW * VW;
  vf part[NU][VW], acc[NU];
  for (int64_t t0 = 0; t0 < whole; t0 += VW) {
    for (int j = 0; j < VW; ++j) {
      dot_lanes<NU>(qf, K + (cols ? cols[t0 + j] : t0 + j) * D, D, acc);
      for (int u = 0; u < NU; ++u) part[u][hsum_slot(j)] = acc[u];
    }
    for (int u = 0; u < NU; ++u) storeu(p + u * n + t0, hsums(part[u]));
  }
  for (int64_t t = whole; t < n; ++t) {
    dot_lanes<NU>(qf, K + (cols ? cols[t] : t) * D, D, acc);
    for (int u = 0; u < NU; ++u) p[u * n + t] = hsum(acc[u]);
  }
}

// For each head u < NU: o_u[d0 .. d0 + M VW) <- (sum_t w_u[t] v(t)) * inv[u], with w_u = w + u * n, the values at
// V + col(t) * D summed in key order; each value's M vectors are loaded once for the NU heads.
template <int NU, int M>
void weighted_values(const float* w, const at::BFloat16* V, const int64_t* cols, int64_t n, int64_t D, int64_t d0,
                     const float* inv, at::BFloat16* o, int64_t stride) {
  vf acc[NU][M];
  for (int u = 0; u < NU; ++u)
    for (int s = 0; s < M; ++s) acc[u][s] = zero();
  for (int64_t t = 0; t < n; ++t) {
    const at::BFloat16* vt = V + (cols ? cols[t] : t) * D + d0;
    vf vv[M];
    for (int s = 0; s < M; ++s) vv[s] = load_bf16(vt + s * VW);
    for (int u = 0; u < NU; ++u) {
      const vf wt = set1(w[u * n + t]);
      for (int s = 0; s < M; ++s) acc[u][s] = fmadd(vv[s], wt, acc[u][s]);
    }
  }
  for (int u = 0; u < NU; ++u) {
    float buf[M * VW];
    for (int s = 0; s < M; ++s) storeu(buf + s * VW, mul(acc[u][s], set1(inv[u])));
    for (int64_t i = 0; i < M * VW; ++i) o[u * stride + d0 + i] = at::BFloat16(buf[i]);
  }
}

// One row's attention for NU query heads of one key/value head: qf [NU, D] fp32 (scaled), the keys and values at
// K + col(t) * D, V + col(t) * D for t < n; out: NU rows of D bf16, `stride` apart.
template <int NU>
void attend(const float* qf, const at::BFloat16* K, const at::BFloat16* V, const int64_t* cols, int64_t n,
            int64_t D, float* p, at::BFloat16* out, int64_t stride) {
  constexpr int M = ACC / NU >= 4 ? 4 : ACC / NU >= 2 ? 2 : 1;  // vectors of the head dimension a pass
  scores<NU>(qf, K, cols, n, D, p);
  float inv[NU];
  for (int u = 0; u < NU; ++u) inv[u] = 1.f / softmax_numerators(p + u * n, n);
  int64_t d0 = 0;
  for (; d0 + M * VW <= D; d0 += M * VW) weighted_values<NU, M>(p, V, cols, n, D, d0, inv, out, stride);
  for (; d0 < D; d0 += VW) weighted_values<NU, 1>(p, V, cols, n, D, d0, inv, out, stride);
}

using Attend = void (*)(const float*, const at::BFloat16*, const at::BFloat16*, const int64_t*, int64_t, int64_t,
                        float*, at::BFloat16*, int64_t);
constexpr Attend ATTEND[HEADS + 1] = {nullptr, attend<1>, attend<2>, attend<3>, attend<4>, attend<5>, attend<6>,
                                      attend<7>, attend<8>};

}  // namespace

namespace selfspec {

void attend_heads(const float* qf, int64_t heads, const at::BFloat16* K, const at::BFloat16* V, const int64_t* cols,
                  int64_t n, int64_t D, std::vector<float>& p, at::BFloat16* out, int64_t stride) {
  p.resize(HEADS * n);
  for (int64_t u0 = 0; u0 < heads; u0 += HEADS) {
    const int64_t nu = std::min(HEADS, heads - u0);
    ATTEND[nu](qf + u0 * D, K, V, cols, n, D, p.data(), out + u0 * stride, stride);
  }
}

}  // namespace selfspec

at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& count, const c10::optional<at::Tensor>& index, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [H, R, D], k and v [KVH, L, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "bf16 q, k, v");
  const int64_t H = q.size(0), R = q.size(1), D = q.size(2), KVH = k.size(0), L = k.size(1);
  TORCH_CHECK(k.size(2) == D && D % VW == 0 && H % KVH == 0, "head dims (a multiple of the vector width), heads");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D && k.stride(0) == v.stride(0),
              "k, v: each head's keys contiguous rows of D");
  TORCH_CHECK(count.scalar_type() == at::kLong && count.is_contiguous() && count.numel() == R, "count: int64 [R]");
  const int64_t* C = count.data_ptr<int64_t>();
  const int64_t* I = nullptr;
  int64_t W = 0;
  if (index.has_value()) {
    TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous() && index->dim() == 2 &&
                index->size(0) == R, "index: contiguous int64 [R, W]");
    I = index->data_ptr<int64_t>();
    W = index->size(1);
  }
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(C[r] >= 1 && C[r] <= (I ? W : L), "each row attends 1 .. its columns' keys");
    for (int64_t t = 0; I && t < C[r]; ++t) TORCH_CHECK(I[r * W + t] >= 0 && I[r * W + t] < L, "index within the keys");
  }
  const at::Tensor qc = q.contiguous();
  const at::BFloat16* Q = qc.data_ptr<at::BFloat16>();
  const at::BFloat16* K = k.data_ptr<at::BFloat16>();
  const at::BFloat16* V = v.data_ptr<at::BFloat16>();
  const int64_t group = H / KVH, hs = k.stride(0);
  auto out = at::empty({R, H, D}, at::kBFloat16);
  at::BFloat16* O = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, R * KVH, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> qf(group * D), p;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / KVH, j = b % KVH;
      for (int64_t u = 0; u < group; ++u) {  // the query in fp32, scaled (as a product's operand is rounded once)
        const at::BFloat16* qh = Q + ((j * group + u) * R + r) * D;
        for (int64_t i = 0; i < D; ++i) qf[u * D + i] = static_cast<float>(qh[i]) * static_cast<float>(scale);
      }
      selfspec::attend_heads(qf.data(), group, K + j * hs, V + j * hs, I ? I + r * W : nullptr, C[r], D, p,
                             O + (r * H + j * group) * D, D);
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(selfspec_vnni, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor count, Tensor? index, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(selfspec_vnni, CPU, m) { m.impl("row_attention", &row_attention); }
