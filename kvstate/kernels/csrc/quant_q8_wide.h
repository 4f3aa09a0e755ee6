// 512-bit forms of the K-quant dots of the "q8" mode, for the AVX-512 instance (quant_q8_avx512.cpp,
// after quant_q8_tile.h: Q8Isa::kquant). Each vector holds the codes of 64 consecutive weights, the order
// of the x codes, so a W block costs one vpmaddubsw and one vpdpwssd per 64 weights and x row (half the
// 256-bit form's instructions). Same integer sums as the 256-bit form; fp32 per block as there.

namespace {

inline __m512i load512(const void* p) { return _mm512_loadu_si512(p); }
inline __m512i bcast256(const void* p) { return _mm512_broadcast_i64x4(load(p)); }
// int16 lanes 0-15 `lo`, 16-31 `hi`
inline __m512i halves16(int lo, int hi) {
  return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(int16_t(lo)), _mm512_set1_epi16(int16_t(hi)));
}
// int16 lanes 8t .. 8t + 7 = j + t (t = 0..3): the 4 Q6_K scales of 64 weights
inline __m512i quarters16(int j) {
  return _mm512_mask_blend_epi16(0xFF00FF00u, halves16(j, j + 2), halves16(j + 1, j + 3));
}
// int32 x16 -> x8, the halves added
inline __m256i fold(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

template <bool FIVE, int MT>
inline void wide_qk(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256* acc) {
  const KScales k = k_scales(b);
  const __m512i sc = _mm512_castsi128_si512(k.sc);
  const uint8_t* qs = b + (FIVE ? 48 : 16);
  [[maybe_unused]] const __m512i qh = bcast256(b + 16);
  const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
  __m512i s[MT];
  for (int r = 0; r < MT; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    // bytes 0-31: the low nibbles (sub-block 2c), 32-63: the high ones (2c + 1)
    __m512i q = bcast256(qs + 32 * c);
    q = _mm512_and_si512(_mm512_mask_srli_epi16(q, 0xFFFF0000u, q, 4), m4);
    if constexpr (FIVE)
      q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, halves16(2 * c, 2 * c + 1)), one), 4));
    const __m512i scl = _mm512_permutexvar_epi16(halves16(2 * c, 2 * c + 1), sc);
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r)
      s[r] = _mm512_dpwssd_epi32(s[r], _mm512_maddubs_epi16(q, load512(xk(x, xrow, r)->qs + 64 * c)), scl);
  }
  __m256i folded[MT];
  for (int r = 0; r < MT; ++r) folded[r] = fold(s[r]);
  finish_qk<MT>(b, x, xrow, k.mins, folded, acc);
}

template <int MT>
inline void wide_q6_k(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256* acc) {
  const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
  const __m512i sc = _mm512_castsi256_si512(sc16);
  const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
  __m512i s[MT];
  for (int r = 0; r < MT; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    // ql byte l: weight 128h + l (low nibble), 128h + 64 + l (high); qh byte l: its 2-bit pairs the high
    // bits of 128h + l, + 32 + l, + 64 + l, + 96 + l
    const __m512i ql = load512(b + 64 * h), qh = bcast256(b + 128 + 32 * h);
    __m512i q[2];
    q[0] = _mm512_or_si512(_mm512_and_si512(ql, m4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, halves16(0, 2)), m3), 4));
    q[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, halves16(4, 6)), m3), 4));
#pragma GCC unroll 2
    for (int t = 0; t < 2; ++t) {
      const __m512i scl = _mm512_permutexvar_epi16(quarters16(8 * h + 4 * t), sc);
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r)
        s[r] = _mm512_dpwssd_epi32(s[r], _mm512_maddubs_epi16(q[t], load512(xk(x, xrow, r)->qs + 128 * h + 64 * t)), scl);
    }
  }
  const float d = q8_f16(b + 208);
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r) {
    const BlockQ8K* y = xk(x, xrow, r);
    const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, load(y->bsums)), 5);  // 32 * sc . bsums
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y->d * d), _mm256_cvtepi32_ps(_mm256_sub_epi32(fold(s[r]), off)), acc[r]);
  }
}

}  // namespace

template <int TYPE, int MT>
void Q8Isa::kquant(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256* acc) {
  if constexpr (TYPE == kQ4_K) wide_qk<false, MT>(b, x, xrow, acc);
  else if constexpr (TYPE == kQ5_K) wide_qk<true, MT>(b, x, xrow, acc);
  else wide_q6_k<MT>(b, x, xrow, acc);
}
