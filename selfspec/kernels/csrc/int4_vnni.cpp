// int4 weights x int8 activations: the draft's int4 products (selfspec/kernels/vnni.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] for bf16 x [M, K] and int4 w, where w = (q - 8) * scale + zero per group of G
// inputs (the values torch's _weight_int4pack_mm_for_cpu computes with). x is rounded to int8 with one scale per
// block of ACT_BLOCK inputs (64 on AVX-512, 128 on AVX2); the integer products run on AVX-512 VNNI's
// _mm512_dpbusd_epi32 (4 u8 x s8 products per lane) where the build targets it (__AVX512VNNI__), else on AVX2's
// _mm256_maddubs_epi16 + _mm256_madd_epi16 (sums of 4 products per lane: a pair of products, at most 2 * 15 * 127,
// fits in int16). The two builds round the activations in blocks of different sizes, so their numbers differ by
// more than the order of the float sums.
//
// Layout of w: [N, K/2] uint8; each 64 bytes hold 128 inputs, byte j = q[j] | q[j + 64] << 4.
// Layout of sz: [N, K/G, 2] bf16 (scale, zero). K % 128 == 0, G in {32, 64, 128, 256}, G | K.
#include <torch/library.h>
#include <torch/torch.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "int4_vnni.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)

// One block of 64 activations x to int8 q: returns their largest magnitude; sum[j] is the sum of q over inputs
// 32j .. 32j + 31. Each q = x * (127 / amax) rounded to nearest, ties to even (the default rounding mode, that of
// std::nearbyint), clamped to +-127: the same values, bit for bit, as an elementwise loop.
inline float quantize_block(const at::BFloat16* x, int8_t* q, int32_t sum[2]) {
  __m512 v[4];
  __m512 top = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = load_bf16(x + 16 * j);
    top = vmax(top, vabs(v[j]));
  }
  const float amax = _mm512_reduce_max_ps(top), inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 s = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i t[4];
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[j], s)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * j), _mm512_cvtepi32_epi8(t[j]));
  }
  sum[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(t[0], t[1]));
  sum[1] = _mm512_reduce_add_epi32(_mm512_add_epi32(t[2], t[3]));
  return amax;
}

#else

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// The AVX-512 build's quantize_block on 256-bit vectors (the same values), for a block of 64 inputs rounded with the
// scale of a larger block (the AVX2 build's blocks are 128 inputs: block_amax): inv = 127 / that block's amax.
inline void quantize_block(const at::BFloat16* x, int8_t* q, int32_t sum[2], float inv) {
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' interleaving of lanes
  __m256i t[8];
  for (int j = 0; j < 8; ++j)
    t[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(load_bf16(x + 8 * j), s)), lo), hi);
  for (int j = 0; j < 8; j += 4) {  // 32 values to 32 bytes
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(t[j], t[j + 1]), _mm256_packs_epi32(t[j + 2], t[j + 3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * j), _mm256_permutevar8x32_epi32(bytes, order));
    sum[j / 4] = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(t[j], t[j + 1]), _mm256_add_epi32(t[j + 2], t[j + 3])));
  }
}

// the largest magnitude of n inputs (n a multiple of 8)
inline float block_amax(const at::BFloat16* x, int64_t n) {
  __m256 top = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) top = vmax(top, vabs(load_bf16(x + j)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

#endif

// Inputs per activation scale: 64 on AVX-512 (a block of 64 is one vpdpbusd), 128 on AVX2, where one scale for the
// 128 inputs of 64 packed bytes lets their four vpmaddubsw sums meet in int16 and take one vpmaddwd, one conversion
// and one multiply-add where blocks of 64 take two of each (groups of 128 and 256: rows_block_wide).
#if defined(__AVX512F__)
constexpr int64_t ACT_BLOCK = 64;
#else
constexpr int64_t ACT_BLOCK = 128;
#endif

// Per row m: xq int8 [M, K], xs [M, K/64] each block of 64's scale (on AVX2 the same for the two of 128 inputs), xg
// [M, K/G] each group's sum of the *rounded* activations (xs * xq), so that the zero point's term and the integer
// products see the same inputs.
void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int64_t G, int8_t* xq, float* xs, float* xg) {
  const int64_t blocks = K / 64;
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t sum[2];  // of each 32 inputs
      const at::BFloat16* xb = x + m * K + b * 64;
#if defined(__AVX512F__)
      amax = quantize_block(xb, xq + m * K + b * 64, sum);
#else
      if (b % (ACT_BLOCK / 64) == 0) amax = block_amax(xb, ACT_BLOCK);  // the first block of 64 of each ACT_BLOCK
      quantize_block(xb, xq + m * K + b * 64, sum, amax > 0.f ? 127.f / amax : 0.f);
#endif
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

// packed bytes read ahead of the chunk in use: the rows are contiguous, so it runs on into the next rows (2 KiB took
// the AVX2 build's one-row product from ~22 to ~29 G weights/s on a Zen 3; with one load per chunk, the AVX-512
// build's MLP products inside a draft step from ~38 to ~50 on a Zen 4, scripts/profile_draft_step.py, docs/log.md)
constexpr int64_t PREFETCH_BYTES = 2048;

#if defined(__AVX512VNNI__)

// Chunk c of a row's bytes (64 bytes, 128 inputs), loaded once: q[0] its low halves (inputs 0-63, block 2c), q[1]
// its high halves (inputs 64-127, block 2c + 1).
inline void chunk_q(const uint8_t* wr, int64_t c, __m512i q[2]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* src = wr + c * 64;
  _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH_BYTES), _MM_HINT_T0);
  const __m512i bytes = _mm512_loadu_si512(static_cast<const void*>(src));
  q[0] = _mm512_and_si512(bytes, low4);
  q[1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
}

// Output rows [n0, n1) for input rows [m0, m0 + MB): each weight byte is loaded and unpacked once for MB rows.
template <int MB>
void rows_block(const uint8_t* W, const at::BFloat16* SZ, const int8_t* XQ, const float* XS, const float* XG,
                at::BFloat16* Y, int64_t K, int64_t N, int64_t G, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t groups = K / G, halves = G / 64, blocks = K / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = W + n * (K / 2);
    const at::BFloat16* szr = SZ + n * groups * 2;
    __m512 acc[MB], acc_g[MB];
    float zero_term[MB];
    for (int i = 0; i < MB; ++i) {
      acc[i] = acc_g[i] = _mm512_setzero_ps();
      zero_term[i] = 0.f;
    }
    int64_t g = 0, e = 0;  // the group, and the blocks of it done
    for (int64_t c = 0; c < blocks / 2; ++c) {
      __m512i q[2];
      chunk_q(wr, c, q);
      for (int half = 0; half < 2; ++half) {
        const int64_t h = 2 * c + half;
        for (int i = 0; i < MB; ++i) {
          const int64_t m = m0 + i;
          const __m512i a = _mm512_loadu_si512(static_cast<const void*>(XQ + m * K + h * 64));
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[half], a);
          acc_g[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(XS[m * blocks + h]), acc_g[i]);
        }
        if (++e < halves) continue;
        const float scale = static_cast<float>(szr[2 * g]), zero = static_cast<float>(szr[2 * g + 1]);
        const __m512 s = _mm512_set1_ps(scale);
        for (int i = 0; i < MB; ++i) {
          acc[i] = _mm512_fmadd_ps(acc_g[i], s, acc[i]);
          acc_g[i] = _mm512_setzero_ps();
          zero_term[i] += (zero - 8.f * scale) * XG[(m0 + i) * groups + g];  // sum (q - 8) s a + z a = s q.a + (z - 8 s) a
        }
        ++g, e = 0;
      }
    }
    for (int i = 0; i < MB; ++i) Y[(m0 + i) * N + n] = at::BFloat16(_mm512_reduce_add_ps(acc[i]) + zero_term[i]);
  }
}

// Groups of 32 (the GGUF's 4-bit blocks): the two groups of a block of 64 inputs fill lanes 0-7 and 8-15 of the
// integer products, so each block takes one vector of the two groups' scales, and the zero points' terms run four
// floats at a time (scale and zero of both groups against -8 and 1 times each group's activation sum).
template <int MB>
void rows_block_g32(const uint8_t* W, const at::BFloat16* SZ, const int8_t* XQ, const float* XS, const float* XG,
                    at::BFloat16* Y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const __m512i spread = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);  // s0 x 8, s1 x 8
  const int64_t groups = K / 32, blocks = K / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = W + n * (K / 2);
    const uint16_t* szr = reinterpret_cast<const uint16_t*>(SZ) + n * groups * 2;
    __m512 acc[MB];
    __m128 zacc[MB];
    for (int i = 0; i < MB; ++i) {
      acc[i] = _mm512_setzero_ps();
      zacc[i] = _mm_setzero_ps();
    }
    for (int64_t c = 0; c < blocks / 2; ++c) {
      __m512i q[2];
      chunk_q(wr, c, q);
      for (int half = 0; half < 2; ++half) {
        const int64_t h = 2 * c + half;
        // (s0, z0, s1, z1) of groups 2h and 2h + 1: bf16 -> fp32 is a shift of 16 bits
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(szr + 4 * h));
        const __m128 sz4 = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(raw), 16));
        const __m512 ws = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(sz4));
        for (int i = 0; i < MB; ++i) {
          const int64_t m = m0 + i;
          const __m512i a = _mm512_loadu_si512(static_cast<const void*>(XQ + m * K + h * 64));
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[half], a);
          const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(XS[m * blocks + h]));
          acc[i] = _mm512_fmadd_ps(scaled, ws, acc[i]);
          const float a0 = XG[m * groups + 2 * h], a1 = XG[m * groups + 2 * h + 1];
          zacc[i] = _mm_fmadd_ps(sz4, _mm_setr_ps(-8.f * a0, a0, -8.f * a1, a1), zacc[i]);
        }
      }
    }
    for (int i = 0; i < MB; ++i) {
      __m128 z = _mm_add_ps(zacc[i], _mm_movehl_ps(zacc[i], zacc[i]));
      z = _mm_add_ss(z, _mm_shuffle_ps(z, z, 1));
      Y[(m0 + i) * N + n] = at::BFloat16(_mm512_reduce_add_ps(acc[i]) + _mm_cvtss_f32(z));
    }
  }
}

#else

// AVX2 + FMA: the same two kernels on 256-bit vectors. A chunk of 64 packed bytes (128 inputs) is loaded once and
// both its nibbles used: inputs 0-31 and 32-63 are the low halves of bytes 0-31 and 32-63 (block 2c), inputs 64-95
// and 96-127 their high halves (block 2c + 1). Integer sums and float order are those of a loop over blocks that
// loads the chunk once per block; with the prefetch, one-row products ran 1.4-1.6x as fast on a Zen 3
// (docs/log.md).


// the int4 values of chunk c of a row's bytes: inputs 0-31, 32-63, 64-95, 96-127
inline void chunk_q(const uint8_t* wr, int64_t c, __m256i q[4]) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const uint8_t* src = wr + c * 64;
  _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH_BYTES), _MM_HINT_T0);
  const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
  const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
  q[0] = _mm256_and_si256(b0, low4);
  q[1] = _mm256_and_si256(b1, low4);
  q[2] = _mm256_and_si256(_mm256_srli_epi16(b0, 4), low4);
  q[3] = _mm256_and_si256(_mm256_srli_epi16(b1, 4), low4);
}

// 8 int32 lanes, each the sum of 4 of the 32 products of q (0..15) and a (int8)
inline __m256i dot32(__m256i q, const int8_t* a) {
  const __m256i pairs = _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// 8 int32 lanes, each the sum of 8 of the 64 products of a block (q0 with a[0, 32), q1 with a[32, 64)): the two
// products' pairs are summed in int16 first (a pair is at most 2 x 15 x 127 = 3810, so two fit)
inline __m256i dot64(__m256i q0, __m256i q1, const int8_t* a) {
  const __m256i p0 = _mm256_maddubs_epi16(q0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m256i p1 = _mm256_maddubs_epi16(q1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32)));
  return _mm256_madd_epi16(_mm256_add_epi16(p0, p1), _mm256_set1_epi16(1));
}

template <int MB>
void rows_block(const uint8_t* W, const at::BFloat16* SZ, const int8_t* XQ, const float* XS, const float* XG,
                at::BFloat16* Y, int64_t K, int64_t N, int64_t G, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t groups = K / G, halves = G / 64, blocks = K / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = W + n * (K / 2);
    const at::BFloat16* szr = SZ + n * groups * 2;
    __m256 acc[MB], acc_g[MB];
    float zero_term[MB];
    for (int i = 0; i < MB; ++i) {
      acc[i] = acc_g[i] = _mm256_setzero_ps();
      zero_term[i] = 0.f;
    }
    int64_t g = 0, e = 0;  // the group, and the blocks of it done
    for (int64_t c = 0; c < blocks / 2; ++c) {
      __m256i q[4];
      chunk_q(wr, c, q);
      for (int half = 0; half < 2; ++half) {
        const int64_t h = 2 * c + half;
        for (int i = 0; i < MB; ++i) {
          const __m256i dot = dot64(q[2 * half], q[2 * half + 1], XQ + (m0 + i) * K + h * 64);
          acc_g[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(XS[(m0 + i) * blocks + h]), acc_g[i]);
        }
        if (++e < halves) continue;
        const float scale = static_cast<float>(szr[2 * g]), zero = static_cast<float>(szr[2 * g + 1]);
        const __m256 s = _mm256_set1_ps(scale);
        for (int i = 0; i < MB; ++i) {
          acc[i] = _mm256_fmadd_ps(acc_g[i], s, acc[i]);
          acc_g[i] = _mm256_setzero_ps();
          zero_term[i] += (zero - 8.f * scale) * XG[(m0 + i) * groups + g];
        }
        ++g, e = 0;
      }
    }
    for (int i = 0; i < MB; ++i) Y[(m0 + i) * N + n] = at::BFloat16(hsum(acc[i]) + zero_term[i]);
  }
}

// The zero points' term of a row: the sum over its groups of (z - 8 s) a, which is the dot product of the row's (s, z)
// pairs with XZ's (-8 a, a) pairs, 8 floats a step and the last few one at a time (bf16 -> fp32 is a shift of 16
// bits). Once a row, apart from the products: inside the loop over blocks it took as many instructions as the
// integer products themselves (groups of 32).
inline float zero_term(const uint16_t* szr, const float* xz, int64_t groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= 2 * groups; j += 8) {
    const __m256i raw = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(szr + j)));
    acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16)), _mm256_loadu_ps(xz + j), acc);
  }
  float rest = hsum(acc);
  for (; j < 2 * groups; ++j) rest += static_cast<float>(at::BFloat16(szr[j], at::BFloat16::from_bits())) * xz[j];
  return rest;
}

// Groups of 128 or 256: the four integer sums of a chunk (its 128 inputs share one activation scale) meet in int16
// (four pairs, at most 4 x 3810, fit), then one vpmaddwd, one conversion and one multiply-add by the scale; each
// group's scale is broadcast from its (scale, zero) pair's 32 bits (a shift of 16 makes the bf16 in the low half
// an fp32), and the zero points' term is taken once a row (zero_term).
template <int MB>
void rows_block_wide(const uint8_t* W, const at::BFloat16* SZ, const int8_t* XQ, const float* XS, const float* XZ,
                     at::BFloat16* Y, int64_t K, int64_t N, int64_t G, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t groups = K / G, chunks_per_group = G / 128, blocks = K / 64;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = W + n * (K / 2);
    const int32_t* sz32 = reinterpret_cast<const int32_t*>(SZ) + n * groups;
    __m256 acc[MB], acc_g[MB];
    for (int i = 0; i < MB; ++i) acc[i] = acc_g[i] = _mm256_setzero_ps();
    int64_t g = 0, e = 0;  // the group, and the chunks of it done
    for (int64_t c = 0; c < blocks / 2; ++c) {
      __m256i q[4];
      chunk_q(wr, c, q);
      for (int i = 0; i < MB; ++i) {
        const int8_t* a = XQ + (m0 + i) * K + c * 128;
        const __m256i p = _mm256_add_epi16(
            _mm256_add_epi16(_mm256_maddubs_epi16(q[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                             _mm256_maddubs_epi16(q[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32)))),
            _mm256_add_epi16(_mm256_maddubs_epi16(q[2], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 64))),
                             _mm256_maddubs_epi16(q[3], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 96)))));
        acc_g[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                                   _mm256_set1_ps(XS[(m0 + i) * blocks + 2 * c]), acc_g[i]);
      }
      if (++e < chunks_per_group) continue;
      const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(sz32[g]), 16));
      for (int i = 0; i < MB; ++i) {
        acc[i] = _mm256_fmadd_ps(acc_g[i], s, acc[i]);
        acc_g[i] = _mm256_setzero_ps();
      }
      ++g, e = 0;
    }
    const uint16_t* szr = reinterpret_cast<const uint16_t*>(sz32);
    for (int i = 0; i < MB; ++i)
      Y[(m0 + i) * N + n] = at::BFloat16(hsum(acc[i]) + zero_term(szr, XZ + (m0 + i) * 2 * groups, groups));
  }
}

// Groups of 32: the two halves of a block are the block's two groups, each with its own scale; XZ [M, 2 K/32]
// holds each group's (-8 a, a) for the zero points' term (zero_term).
template <int MB>
void rows_block_g32(const uint8_t* W, const at::BFloat16* SZ, const int8_t* XQ, const float* XS, const float* XZ,
                    at::BFloat16* Y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t groups = K / 32, blocks = K / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = W + n * (K / 2);
    const uint16_t* szr = reinterpret_cast<const uint16_t*>(SZ) + n * groups * 2;
    __m256 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < blocks / 2; ++c) {
      __m256i q[4];
      chunk_q(wr, c, q);
      for (int half = 0; half < 2; ++half) {
        const int64_t h = 2 * c + half;
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(szr + 4 * h));
        const __m128 sz4 = _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(raw), 16));  // s0, z0, s1, z1
        const __m256 s0 = _mm256_broadcastss_ps(sz4), s1 = _mm256_broadcastss_ps(_mm_movehl_ps(sz4, sz4));
        for (int i = 0; i < MB; ++i) {
          const int64_t m = m0 + i;
          const int8_t* a = XQ + m * K + h * 64;
          const __m256 both = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(q[2 * half], a)), s0,
                                              _mm256_mul_ps(_mm256_cvtepi32_ps(dot32(q[2 * half + 1], a + 32)), s1));
          acc[i] = _mm256_fmadd_ps(both, _mm256_set1_ps(XS[m * blocks + h]), acc[i]);
        }
      }
    }
    for (int i = 0; i < MB; ++i)
      Y[(m0 + i) * N + n] = at::BFloat16(hsum(acc[i]) + zero_term(szr, XZ + (m0 + i) * 2 * groups, groups));
  }
}

#endif

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

torch::Tensor int4_mm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& sz, int64_t G) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bf16 [M, K]");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w: contiguous uint8 [N, K/2]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 128 == 0 && (G == 32 || G % 64 == 0) && K % G == 0 && w.size(1) == K / 2,
              "K % 128, G 32 or a multiple of 64, K % G, w [N, K/2]");
  TORCH_CHECK(sz.scalar_type() == torch::kBFloat16 && sz.is_contiguous() && sz.numel() == N * (K / G) * 2,
              "sz: contiguous bf16 [N, K/G, 2]");
  auto xq = torch::empty({M, K}, torch::kInt8);
  auto xs = torch::empty({M, K / 64}, torch::kFloat);
  auto xg = torch::empty({M, K / G}, torch::kFloat);
  quantize_rows(x.data_ptr<at::BFloat16>(), M, K, G, xq.data_ptr<int8_t>(), xs.data_ptr<float>(), xg.data_ptr<float>());
  auto y = torch::empty({M, N}, torch::kBFloat16);
  const uint8_t* W = w.data_ptr<uint8_t>();
  const at::BFloat16* SZ = sz.data_ptr<at::BFloat16>();
  const int8_t* XQ = xq.data_ptr<int8_t>();
  const float* XS = xs.data_ptr<float>();
  const float* XG = xg.data_ptr<float>();
#if !defined(__AVX512VNNI__)
  // AVX2, groups of 32, 128 and 256: each group's (-8 a, a), for the zero points' term as one dot product a row
  const bool pairs = G == 32 || G % 128 == 0;
  auto xz = torch::empty({M, pairs ? 2 * (K / G) : 0}, torch::kFloat);
  if (pairs) {
    float* z = xz.data_ptr<float>();
    for (int64_t j = 0; j < M * (K / G); ++j) z[2 * j] = -8.f * XG[j], z[2 * j + 1] = XG[j];
  }
  const float* XZ = xz.data_ptr<float>();
#else
  const float* XZ = XG;
#endif
  at::BFloat16* Y = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      by_rows(std::min<int64_t>(4, M - m0), [&](auto rows) {
        constexpr int MB = decltype(rows)::value;
        if (G == 32) rows_block_g32<MB>(W, SZ, XQ, XS, XZ, Y, K, N, m0, n0, n1);
#if !defined(__AVX512VNNI__)
        else if (G % 128 == 0) rows_block_wide<MB>(W, SZ, XQ, XS, XZ, Y, K, N, G, m0, n0, n1);
#endif
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
