// The fused draft calls (selfspec/draft/fused.py): a kept Llama/Qwen2 sublayer of a draft step in one call, its
// products on the int4 kernel (int4_vnni.cpp), its attention on the row attention's core and its SiLU on the vector
// math of vec.h.
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include "int4_vnni.h"
#include "row_attention.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <vector>

// One draft step's attention sublayer of a Llama/Qwen2 layer, after its input norm (selfspec/draft/fused.py):
// q/k/v through one stacked int4 product (plus their biases), the rotary embedding (cos/sin [R, D] of the rows'
// positions, rotate-half form), the rows' keys/values written to cache slots start .. start+R-1 of kc/vc
// [KVH, L, D], causal attention of row i over slots 0 .. start+i (row_attention.h: scores and softmax in fp32, a key
// read once for its head group),
// then o_proj's int4 product. h [R, E] bf16 -> [R, E'] bf16.
at::Tensor draft_attention(const at::Tensor& h, const at::Tensor& qkv_w, const at::Tensor& qkv_sz,
                           const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_w,
                           const at::Tensor& o_sz, int64_t G, const at::Tensor& cos, const at::Tensor& sin,
                           at::Tensor kc, at::Tensor vc, int64_t start, int64_t heads, int64_t kv_heads,
                           double scale) {
  const int64_t R = h.size(0), D = kc.size(2), L = kc.size(1);
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous() && kc.scalar_type() == at::kBFloat16 &&
              vc.sizes() == kc.sizes() && kc.size(0) == kv_heads, "kc, vc: contiguous bf16 [KVH, L, D]");
  TORCH_CHECK(D % 32 == 0 && heads % kv_heads == 0 && start >= 0 && start + R <= L, "head dim % 32, heads, slots");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kBFloat16 &&
              cos.size(0) == R && cos.size(1) == D, "cos, sin: contiguous bf16 [R, D]");
  at::Tensor qkv = int4_mm(h, qkv_w, qkv_sz, G);  // [R, (H + 2 KVH) D]
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * D, "qkv rows: (heads + 2 kv_heads) * head_dim");
  const int64_t width = qkv.size(1), half = D / 2, group = heads / kv_heads;
  // rows' q (fp32, rotated, scaled) and k/v (rotated k) in bf16 into the cache
  std::vector<float> q(R * heads * D);
  const at::BFloat16* bias = qkv_bias.has_value() ? qkv_bias->data_ptr<at::BFloat16>() : nullptr;
  const at::BFloat16* C = cos.data_ptr<at::BFloat16>();
  const at::BFloat16* S = sin.data_ptr<at::BFloat16>();
  at::BFloat16* Q = qkv.data_ptr<at::BFloat16>();
  at::BFloat16* KC = kc.data_ptr<at::BFloat16>();
  at::BFloat16* VC = vc.data_ptr<at::BFloat16>();
  std::vector<float> v(D);
  for (int64_t r = 0; r < R; ++r) {
    at::BFloat16* row = Q + r * width;
    for (int64_t j = 0; j < width; ++j) {  // the projections' bias, rounded as nn.Linear's output is
      if (bias) row[j] = at::BFloat16(static_cast<float>(row[j]) + static_cast<float>(bias[j]));
    }
    const at::BFloat16* c = C + r * D;
    const at::BFloat16* s = S + r * D;
    for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
      const at::BFloat16* x = row + hd * D;
      for (int64_t i = 0; i < D; ++i) {  // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        const float rot = i < half ? -static_cast<float>(x[i + half]) : static_cast<float>(x[i - half]);
        v[i] = static_cast<float>(x[i]) * static_cast<float>(c[i]) + rot * static_cast<float>(s[i]);
      }
      if (hd < heads) {  // the query scaled, as the attention takes it (row_attention.h)
        for (int64_t i = 0; i < D; ++i) q[(r * heads + hd) * D + i] = v[i] * static_cast<float>(scale);
      } else {
        at::BFloat16* dst = KC + ((hd - heads) * L + start + r) * D;
        for (int64_t i = 0; i < D; ++i) dst[i] = at::BFloat16(v[i]);
      }
    }
    for (int64_t j = 0; j < kv_heads; ++j) {
      const at::BFloat16* x = row + (heads + kv_heads + j) * D;
      std::copy(x, x + D, VC + (j * L + start + r) * D);
    }
  }
  auto out = at::empty({R, heads * D}, at::kBFloat16);
  at::BFloat16* O = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, R * kv_heads, 1, [&](int64_t b0, int64_t b1) {  // row r's heads of key/value head j
    std::vector<float> p;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r = b / kv_heads, j = b % kv_heads;
      selfspec::attend_heads(q.data() + (r * heads + j * group) * D, group, KC + j * L * D, VC + j * L * D, nullptr,
                             start + r + 1, D, p, O + (r * heads + j * group) * D, D);
    }
  });
  return int4_mm(out, o_w, o_sz, G);
}

namespace {

// VW values of silu(g) rounded to bf16, times u, rounded to bf16: silu(g) = g / (1 + e^-g), computed with
// e = e^-|g| as g / (1 + e) for g >= 0 and g e / (1 + e) below, so that no exponential overflows.
inline void silu_mul_vector(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* out) {
  const vf x = load_bf16(g);
  const vf e = exp_neg(sub(zero(), vabs(x)));
  const vf silu = round_bf16(div(times_below_zero(x, e), add(set1(1.f), e)));
  store_bf16(out, mul(silu, load_bf16(u)));
}

// out[i] = bf16(bf16(silu(g[i])) * u[i]) for i < n, as a SiLU MLP module rounds each operator's output.
void silu_mul(const at::BFloat16* g, const at::BFloat16* u, at::BFloat16* out, int64_t n) {
  const int64_t whole = n / VW * VW;
  for (int64_t i = 0; i < whole; i += VW) silu_mul_vector(g + i, u + i, out + i);
  if (whole == n) return;
  at::BFloat16 gb[VW] = {}, ub[VW] = {}, ob[VW];
  std::copy(g + whole, g + n, gb);
  std::copy(u + whole, u + n, ub);
  silu_mul_vector(gb, ub, ob);
  std::copy(ob, ob + (n - whole), out + whole);
}

}  // namespace

// One draft step's MLP sublayer of a Llama/Qwen2 layer (SiLU), after its norm: gate/up through one stacked int4
// product ([R, 2I]: gate rows, then up rows), silu(gate) * up rounded to bf16 as the module rounds each (vectorized, on
// one thread: a parallel region costs more than the work), then down.
at::Tensor draft_mlp(const at::Tensor& h, const at::Tensor& gu_w, const at::Tensor& gu_sz,
                     const at::Tensor& down_w, const at::Tensor& down_sz, int64_t G) {
  at::Tensor gu = int4_mm(h, gu_w, gu_sz, G);
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  auto act = at::empty({R, I}, at::kBFloat16);
  const at::BFloat16* X = gu.data_ptr<at::BFloat16>();
  at::BFloat16* A = act.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < R; ++r) silu_mul(X + r * 2 * I, X + r * 2 * I + I, A + r * I, I);
  return int4_mm(act, down_w, down_sz, G);
}

namespace {

// Llama/Qwen2 RMSNorm as transformers computes it: in fp32, x * rsqrt(mean(x^2) + eps), rounded to bf16, times the
// bf16 weight (rounded again). h [R, E] bf16 -> [R, E] bf16.
at::Tensor rms_norm(const at::Tensor& h, const at::Tensor& w, double eps) {
  TORCH_CHECK(h.scalar_type() == at::kBFloat16 && h.dim() == 2 && h.is_contiguous(), "h: contiguous bf16 [R, E]");
  const int64_t R = h.size(0), E = h.size(1);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.numel() == E, "norm weight: bf16 [E]");
  auto out = at::empty({R, E}, at::kBFloat16);
  const at::BFloat16* X = h.data_ptr<at::BFloat16>();
  const at::BFloat16* W = w.data_ptr<at::BFloat16>();
  at::BFloat16* Y = out.data_ptr<at::BFloat16>();
  for (int64_t r = 0; r < R; ++r) {
    const at::BFloat16* x = X + r * E;
    float sq = 0.f;
    for (int64_t i = 0; i < E; ++i) sq += static_cast<float>(x[i]) * static_cast<float>(x[i]);
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(E) + static_cast<float>(eps));
    for (int64_t i = 0; i < E; ++i) {
      const float normed = static_cast<float>(at::BFloat16(static_cast<float>(x[i]) * inv));
      Y[r * E + i] = at::BFloat16(static_cast<float>(W[i]) * normed);
    }
  }
  return out;
}

// y = h + y in bf16, as the decoder layer adds a sublayer's output to the residual stream.
at::Tensor add_residual(const at::Tensor& h, at::Tensor y) {
  TORCH_CHECK(y.sizes() == h.sizes() && y.is_contiguous(), "a sublayer's output has the residual's shape");
  const at::BFloat16* X = h.data_ptr<at::BFloat16>();
  at::BFloat16* Y = y.data_ptr<at::BFloat16>();
  for (int64_t i = 0, n = h.numel(); i < n; ++i) Y[i] = at::BFloat16(static_cast<float>(X[i]) + static_cast<float>(Y[i]));
  return y;
}

}  // namespace

// A kept sublayer with its norm and residual (selfspec/draft/fused.py, FusedStep): h + sublayer(rms_norm(h)).
at::Tensor draft_attention_block(const at::Tensor& h, const at::Tensor& norm_w, double eps,
                                 const at::Tensor& qkv_w, const at::Tensor& qkv_sz,
                                 const c10::optional<at::Tensor>& qkv_bias, const at::Tensor& o_w,
                                 const at::Tensor& o_sz, int64_t G, const at::Tensor& cos,
                                 const at::Tensor& sin, at::Tensor kc, at::Tensor vc, int64_t start,
                                 int64_t heads, int64_t kv_heads, double scale) {
  at::Tensor y = draft_attention(rms_norm(h, norm_w, eps), qkv_w, qkv_sz, qkv_bias, o_w, o_sz, G, cos, sin, kc, vc,
                                 start, heads, kv_heads, scale);
  return add_residual(h, y);
}

at::Tensor draft_mlp_block(const at::Tensor& h, const at::Tensor& norm_w, double eps,
                           const at::Tensor& gu_w, const at::Tensor& gu_sz, const at::Tensor& down_w,
                           const at::Tensor& down_sz, int64_t G) {
  return add_residual(h, draft_mlp(rms_norm(h, norm_w, eps), gu_w, gu_sz, down_w, down_sz, G));
}

TORCH_LIBRARY_FRAGMENT(selfspec_vnni, m) {
  m.def("draft_attention(Tensor h, Tensor qkv_w, Tensor qkv_sz, Tensor? qkv_bias, Tensor o_w, Tensor o_sz, "
        "int group_size, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, int start, int heads, int kv_heads, "
        "float scale) -> Tensor");
  m.def("draft_mlp(Tensor h, Tensor gu_w, Tensor gu_sz, Tensor down_w, Tensor down_sz, int group_size) -> Tensor");
  m.def("draft_attention_block(Tensor h, Tensor norm_w, float eps, Tensor qkv_w, Tensor qkv_sz, Tensor? qkv_bias, "
        "Tensor o_w, Tensor o_sz, int group_size, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, int start, "
        "int heads, int kv_heads, float scale) -> Tensor");
  m.def("draft_mlp_block(Tensor h, Tensor norm_w, float eps, Tensor gu_w, Tensor gu_sz, Tensor down_w, "
        "Tensor down_sz, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(selfspec_vnni, CPU, m) {
  m.impl("draft_attention", &draft_attention);
  m.impl("draft_mlp", &draft_mlp);
  m.impl("draft_attention_block", &draft_attention_block);
  m.impl("draft_mlp_block", &draft_mlp_block);
}
