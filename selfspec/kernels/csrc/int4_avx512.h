// The int4 product's AVX-512 VNNI build: the activations' int8 rounding with one scale per 128 inputs and the row
// kernels on _mm512_dpbusd_epi32. int4_vnni.cpp includes it inside its namespace, after ACT_BLOCK and PREFETCH_BYTES.
#pragma once

// One block of 64 activations x to int8 q with the scale of the block of 128 it belongs to (block_amax): inv =
// 127 / that block's amax; sum[j] is the sum of q over inputs 32j .. 32j + 31. Each q = x * inv rounded to nearest,
// ties to even (the default rounding mode, that of std::nearbyint), clamped to +-127: the same values, bit for bit, as
// an elementwise loop, and as the AVX2 build's.
inline void quantize_block(const at::BFloat16* x, int8_t* q, int32_t sum[2], float inv) {
  const __m512 s = _mm512_set1_ps(inv);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  __m512i t[4];
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(x + 16 * j), s)), lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * j), _mm512_cvtepi32_epi8(t[j]));
  }
  sum[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(t[0], t[1]));
  sum[1] = _mm512_reduce_add_epi32(_mm512_add_epi32(t[2], t[3]));
}

// Chunk c of a row's bytes (64 bytes, 128 inputs), loaded once: q[0] its low halves (inputs 0-63, block 2c), q[1]
// its high halves (inputs 64-127, block 2c + 1). Two prefetches run ahead of it: into L1 (PREFETCH_BYTES) and, further,
// into L2 (PREFETCH_L2_BYTES).
inline void chunk_q(const uint8_t* wr, int64_t c, __m512i q[2]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const uint8_t* src = wr + c * 64;
  _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH_BYTES), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(src + PREFETCH_L2_BYTES), _MM_HINT_T1);
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

// The zero points' term of a row: the sum over its groups of (z - 8 s) a, the dot product of the row's (s, z) pairs
// with XZ's (-8 a, a) pairs, 16 floats a step and the rest under a mask (bf16 -> fp32 is a shift of 16 bits).
inline float zero_term(const uint16_t* szr, const float* xz, int64_t groups) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < 2 * groups; j += 16) {
    const __mmask16 live = j + 16 <= 2 * groups ? __mmask16(0xFFFF) : __mmask16((1u << (2 * groups - j)) - 1);
    const __m512i raw = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, szr + j));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(raw, 16)), _mm512_maskz_loadu_ps(live, xz + j), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// Groups of 128 or 256: the 128 inputs of a chunk share one activation scale, so their two vpdpbusd sums meet in
// int32 and take one conversion and one multiply-add, by the activation scale times the group's scale; the zero
// points' term is taken once a row (zero_term).
template <int MB>
void rows_block_wide(const uint8_t* W, const at::BFloat16* SZ, const int8_t* XQ, const float* XS, const float* XZ,
                     at::BFloat16* Y, int64_t K, int64_t N, int64_t G, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t groups = K / G, chunks_per_group = G / 128, blocks = K / 64;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = W + n * (K / 2);
    const uint16_t* szr = reinterpret_cast<const uint16_t*>(SZ) + n * groups * 2;
    __m512 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t c = 0; c < blocks / 2; ++c) {
      __m512i q[2];
      chunk_q(wr, c, q);
      const float scale = static_cast<float>(at::BFloat16(szr[2 * (c / chunks_per_group)], at::BFloat16::from_bits()));
      for (int i = 0; i < MB; ++i) {
        const int8_t* a = XQ + (m0 + i) * K + c * 128;
        const __m512i dot = _mm512_dpbusd_epi32(
            _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], _mm512_loadu_si512(static_cast<const void*>(a))), q[1],
            _mm512_loadu_si512(static_cast<const void*>(a + 64)));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(XS[(m0 + i) * blocks + 2 * c] * scale), acc[i]);
      }
    }
    for (int i = 0; i < MB; ++i)
      Y[(m0 + i) * N + n] = at::BFloat16(_mm512_reduce_add_ps(acc[i]) + zero_term(szr, XZ + (m0 + i) * 2 * groups, groups));
  }
}
