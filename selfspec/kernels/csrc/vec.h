// The vector math of the decode kernels, on AVX-512 (16 fp32 lanes) where the build targets it (__AVX512F__), else on
// AVX2 (8 lanes): loads and stores of bf16, the few operations the kernels use, and exp_neg, the exponential that
// the row attention's softmax and the fused MLP's SiLU share. Included by row_attention.cpp, int4_vnni.cpp and
// draft_fused.cpp; an unnamed namespace, so that each source, built with its own flags, keeps its own copy.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cstdint>

namespace {

#if defined(__AVX512F__)
using vf = __m512;
constexpr int64_t VW = 16;
inline vf load_bf16(const at::BFloat16* p) {  // bf16 -> fp32 is a shift of 16 bits
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline vf loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void storeu(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf round_nearest(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf pow2(vf n) {  // 2^n for whole n in -126 .. 127, through the exponent bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
inline float hsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float hmax(vf x) { return _mm512_reduce_max_ps(x); }
// hsum of VW vectors at once: lane t of the result is hsum(x[hsum_slot(t)]), its additions paired as hsum's own
// (lanes i and i + 8, then i and i + 4, then 0 + 2 and 1 + 3, then those two), so it is bit for bit the same.
constexpr int hsum_slot(int t) { return 8 * (t % 2) + 4 * (t / 2 % 2) + t / 4; }
inline vf hsums(const vf* x) {
  vf c[8], e[4], g[2];
  for (int p = 0; p < 8; ++p)
    c[p] = add(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x44), _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; ++q)
    e[q] = add(_mm512_shuffle_f32x4(c[2 * q], c[2 * q + 1], 0x88), _mm512_shuffle_f32x4(c[2 * q], c[2 * q + 1], 0xDD));
  for (int r = 0; r < 2; ++r)
    g[r] = add(_mm512_shuffle_ps(e[r], e[r + 2], 0x44), _mm512_shuffle_ps(e[r], e[r + 2], 0xEE));
  return add(_mm512_shuffle_ps(g[0], g[1], 0x88), _mm512_shuffle_ps(g[0], g[1], 0xDD));
}
inline vf vabs(vf x) { return _mm512_abs_ps(x); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf times_below_zero(vf g, vf e) {  // g * e where g < 0, else g
  return _mm512_mask_mul_ps(g, _mm512_cmp_ps_mask(g, zero(), _CMP_LT_OQ), g, e);
}
inline __m512i bf16_bits(vf x) {  // fp32 -> the bits of the nearest bf16 (ties to even) in each lane's low half
  const __m512i b = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}
inline vf round_bf16(vf x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
inline void store_bf16(at::BFloat16* p, vf x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}
#else
using vf = __m256;
constexpr int64_t VW = 8;
inline vf load_bf16(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline vf loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void storeu(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf round_nearest(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf pow2(vf n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline float hsum(vf x) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
inline float hmax(vf x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
// hsum of VW vectors at once: lane t of the result is hsum(x[hsum_slot(t)]), its additions paired as hsum's own
// (lanes i and i + 4, then 0 + 2 and 1 + 3, then those two), so it is bit for bit the same.
constexpr int hsum_slot(int t) { return 2 * (t % 4) + t / 4; }
inline vf hsums(const vf* x) {
  vf c[4], g[2];
  for (int p = 0; p < 4; ++p)
    c[p] = add(_mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x20), _mm256_permute2f128_ps(x[2 * p], x[2 * p + 1], 0x31));
  for (int r = 0; r < 2; ++r)
    g[r] = add(_mm256_shuffle_ps(c[2 * r], c[2 * r + 1], 0x44), _mm256_shuffle_ps(c[2 * r], c[2 * r + 1], 0xEE));
  return add(_mm256_shuffle_ps(g[0], g[1], 0x88), _mm256_shuffle_ps(g[0], g[1], 0xDD));
}
inline vf vabs(vf x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf times_below_zero(vf g, vf e) { return _mm256_blendv_ps(g, mul(g, e), _mm256_cmp_ps(g, zero(), _CMP_LT_OQ)); }
inline __m256i bf16_bits(vf x) {
  const __m256i b = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
}
inline vf round_bf16(vf x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
inline void store_bf16(at::BFloat16* p, vf x) {  // eight 16-bit halves: pack within lanes, then the two lanes' low 64 bits
  const __m256i packed = _mm256_packus_epi32(bf16_bits(x), bf16_bits(x));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}
#endif

// exp(x) for x <= 0 (a score minus its row's largest), elementwise: x = n ln2 + r, |r| <= ln2 / 2, e^r by its
// degree-6 Taylor polynomial (relative error ~2e-7, about std::exp's), times 2^n through the exponent bits. Lanes
// do not interact, so a key's exponential is the same in every row and at every lane.
inline vf exp_neg(vf x) {
  x = vmax(x, set1(-87.f));
  const vf n = round_nearest(mul(x, set1(1.44269504f)));
  const vf r = fmadd(n, set1(-1.42860677e-06f), fmadd(n, set1(-0.693145752f), x));  // x - n ln2, ln2 in two parts
  vf y = set1(1.f / 720.f);
  y = fmadd(y, r, set1(1.f / 120.f));
  y = fmadd(y, r, set1(1.f / 24.f));
  y = fmadd(y, r, set1(1.f / 6.f));
  y = fmadd(y, r, set1(0.5f));
  y = fmadd(y, r, set1(1.f));
  y = fmadd(y, r, set1(1.f));
  return mul(y, pow2(n));
}

}  // namespace
