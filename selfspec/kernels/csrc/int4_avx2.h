// The int4 product's AVX2 build: the activations' int8 rounding with one scale per 128 inputs and the row kernels
// on _mm256_maddubs_epi16 + _mm256_madd_epi16. int4_vnni.cpp includes it inside its namespace, after ACT_BLOCK
// and PREFETCH_BYTES.
#pragma once

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// The AVX-512 build's quantize_block on 256-bit vectors (the same values): a block of 64 inputs rounded with the
// scale of the block of 128 it belongs to (block_amax): inv = 127 / that block's amax.
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
