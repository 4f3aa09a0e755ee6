// The "q8" mode's kernels (quant_blocks.h): x quantized as ggml's vec_dot_type, then per weight block an
// integer dot product with each x row, the block's float scales applied once per block in fp32, as ggml's
// ggml_vec_dot_*_q8_* (arch/x86/quants.c) do. Included once per ISA, inside its namespace and target
// pragma (quant_q8_avx512.cpp, quant_q8_avx2.cpp), after a `struct Q8Isa` with
//   dot_us(acc, u, s):      acc (int32 x8) += the sums of 4 products u8 * s8
//   dot_scaled(acc, p, sc): acc (int32 x8) += the sums of 2 products int16 * int16
//   kRows:                  x rows a W block is multiplied with while in registers
//   kWideK, kquant<TYPE, MT>: the ISA's own form of the K-quant dots (AVX-512: quant_q8_wide.h)
// The forms here use 256-bit vectors.

namespace {

inline float q8_f16(const void* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// 4 x 8 int32 (each within int8) -> 32 int8 in order
inline __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// C's roundf (halves away from zero), as quantize_row_q8_0_ref and gguf's Q8_0 round
inline __m256i round_away(__m256 v) {
  const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 half = _mm256_cmp_ps(abs_ps(_mm256_sub_ps(v, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 one = _mm256_or_ps(_mm256_set1_ps(1.f), _mm256_and_ps(v, _mm256_set1_ps(-0.f)));  // +-1
  return _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_and_ps(half, one)));
}

// quantize_row_q8_0_ref: d = amax / 127 (its fp16 stored), codes roundf(x * (1 / d)) with the fp32 d
void quantize_q8_0(const float* x, int64_t K, BlockQ8_0* y) {
  for (int64_t i = 0; i < K / 32; ++i, x += 32) {
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 8 * j);
      amax = _mm256_max_ps(amax, abs_ps(v[j]));
    }
    const float d = hmax(amax) / 127.f;
    const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
    y[i].d = _cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[i].qs),
                        pack_i8(round_away(_mm256_mul_ps(v[0], id)), round_away(_mm256_mul_ps(v[1], id)),
                                round_away(_mm256_mul_ps(v[2], id)), round_away(_mm256_mul_ps(v[3], id))));
  }
}

// quantize_row_q8_K_ref: max the first x of the largest |x|, iscale = -127 / max (the sign trick: the
// codes of the largest x are -127, never -128), codes nearest_int(iscale * x) (ties to even, as
// vcvtps2dq), d = 1 / iscale; bsums the sum of each 16 codes
void quantize_q8_k(const float* x, int64_t K, BlockQ8K* y) {
  for (int64_t i = 0; i < K / 256; ++i, x += 256) {
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 256; j += 8) amax = _mm256_max_ps(amax, abs_ps(_mm256_loadu_ps(x + j)));
    const float am = hmax(amax);
    if (am == 0.f) {
      __builtin_memset(&y[i], 0, sizeof(BlockQ8K));
      continue;
    }
    float max = 0.f;
    for (int j = 0; j < 256; j += 8) {
      const int hit = _mm256_movemask_ps(_mm256_cmp_ps(abs_ps(_mm256_loadu_ps(x + j)), _mm256_set1_ps(am), _CMP_EQ_OQ));
      if (hit) {
        max = x[j + __builtin_ctz(hit)];
        break;
      }
    }
    const float iscale = -127.f / max;
    const __m256 is = _mm256_set1_ps(iscale);
    const __m256i top = _mm256_set1_epi32(127);
    for (int j = 0; j < 256; j += 32) {
      __m256i q[4];
      for (int t = 0; t < 4; ++t)
        q[t] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * t), is)), top);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[i].qs + j), pack_i8(q[0], q[1], q[2], q[3]));
    }
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int t = 0; t < 16; ++t) s += y[i].qs[16 * g + t];
      y[i].bsums[g] = int16_t(s);
    }
    y[i].d = 1.f / iscale;
  }
}

// ---- one W block against MT x rows (x: the row m0's block, the next rows xrow bytes apart) ----

inline const BlockQ8K* xk(const uint8_t* x, int64_t xrow, int r) {
  return reinterpret_cast<const BlockQ8K*>(x + r * xrow);
}

// broadcast int16 lane i (of each 128-bit half) to all lanes
inline __m256i lane16(__m256i v, int i) { return _mm256_shuffle_epi8(v, _mm256_set1_epi16(int16_t(0x0100 + 0x0202 * i))); }

// A Q4_K / Q5_K block's 8 scales as int16 (lanes 0-7) and its mins one per bsum (m0 m0 m1 m1 ..)
struct KScales {
  __m128i sc;
  __m256i mins;
};
inline KScales k_scales(const uint8_t* b) {
  uint32_t u[4];
  k4_scales_mins(b, u);
  const __m128i m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2));
  return {_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))),
          _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8))};
}

// acc += x's d * (d * the block's integer sums s - dmin * (mins . bsums)), for each x row: the W
// block's d and dmin broadcast once, x's d the one factor each row broadcasts (from memory)
template <int MT>
inline void finish_qk(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256i mins, const __m256i* s, __m256* acc) {
  const __m256 d = _mm256_set1_ps(q8_f16(b)), dmin = _mm256_set1_ps(q8_f16(b + 2));
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r) {
    const BlockQ8K* y = xk(x, xrow, r);
    const __m256 m = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_madd_epi16(mins, load(y->bsums))));
    acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&y->d), _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(s[r]), m), acc[r]);
  }
}

// Q4_K (FIVE: Q5_K): sum_j d*sc_j * (codes_j . x_j) - dmin*m_j * (the bsums of sub-block j), codes 0..15 (31)
template <bool FIVE, int MT>
inline void dot_qk(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256* acc) {
  const KScales k = k_scales(b);
  const __m256i sc = _mm256_broadcastsi128_si256(k.sc);
  const uint8_t* qs = b + (FIVE ? 48 : 16);
  [[maybe_unused]] const __m256i qh = load(b + 16);
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  __m256i s[MT];
  for (int r = 0; r < MT; ++r) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m256i q = load(qs + 32 * c);
    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
    if constexpr (FIVE) {
      lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
      hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
    }
    const __m256i slo = lane16(sc, 2 * c), shi = lane16(sc, 2 * c + 1);
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) {
      const int8_t* xq = xk(x, xrow, r)->qs + 64 * c;
      s[r] = Q8Isa::dot_scaled(s[r], _mm256_maddubs_epi16(lo, load(xq)), slo);
      s[r] = Q8Isa::dot_scaled(s[r], _mm256_maddubs_epi16(hi, load(xq + 32)), shi);
    }
  }
  finish_qk<MT>(b, x, xrow, k.mins, s, acc);
}

// Q6_K: d * sum_j sc_j * ((codes_j - 32) . x_j), the -32 through the bsums: codes 0..63 for maddubs
template <int MT>
inline void dot_q6_k(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256* acc) {
  const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
  const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
  __m256i s[MT];
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
    s[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, load(xk(x, xrow, r)->bsums)), 5));
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = load(b + 64 * h), l1 = load(b + 64 * h + 32), qh = load(b + 128 + 32 * h);
    __m256i q[4];  // weights 128h + 32t .. + 32
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m3), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m3), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m3), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m3), 4));
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      // scales 8h + 2t (the first 16 weights) and 8h + 2t + 1, as int16 lanes 0-7 and 8-15
      const int j = 8 * h + 2 * t;
      const __m128i pick = _mm_setr_epi8(j, j, j, j, j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1, j + 1);
      const __m256i scl = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
#pragma GCC unroll 8
      for (int r = 0; r < MT; ++r)
        s[r] = Q8Isa::dot_scaled(s[r], _mm256_maddubs_epi16(q[t], load(xk(x, xrow, r)->qs + 128 * h + 32 * t)), scl);
    }
  }
  const float d = q8_f16(b + 208);
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r)
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(xk(x, xrow, r)->d * d), _mm256_cvtepi32_ps(s[r]), acc[r]);
}

// Q8_0 / Q4_0 (codes w, signed) against block_q8_0 x: |w| . (x * sign(w)), as ggml's mul_sum_i8_pairs
template <int MT>
inline void dot_q8_0_codes(__m256i w, float dw, const uint8_t* x, int64_t xrow, __m256* acc) {
  const __m256i aw = _mm256_sign_epi8(w, w);
#pragma GCC unroll 8
  for (int r = 0; r < MT; ++r) {
    const auto* y = reinterpret_cast<const BlockQ8_0*>(x + r * xrow);
    const __m256i p = Q8Isa::dot_us(_mm256_setzero_si256(), aw, _mm256_sign_epi8(load(y->qs), w));
    acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * _cvtsh_ss(y->d)), _mm256_cvtepi32_ps(p), acc[r]);
  }
}

// I: Q8Isa (a parameter, so that its own K-quant form, I::kquant, is looked up only where it has one)
template <int TYPE, int MT, class I = Q8Isa>
inline void dot_block(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256* acc) {
  constexpr bool kquant = TYPE == kQ4_K || TYPE == kQ5_K || TYPE == kQ6_K;
  if constexpr (kquant && I::kWideK) I::template kquant<TYPE, MT>(b, x, xrow, acc);
  else if constexpr (TYPE == kQ4_K) dot_qk<false, MT>(b, x, xrow, acc);
  else if constexpr (TYPE == kQ5_K) dot_qk<true, MT>(b, x, xrow, acc);
  else if constexpr (TYPE == kQ6_K) dot_q6_k<MT>(b, x, xrow, acc);
  else if constexpr (TYPE == kQ8_0) dot_q8_0_codes<MT>(load(b + 2), q8_f16(b), x, xrow, acc);
  else {  // Q4_0: qs[j] holds weight j (low nibble) and j + 16, each minus 8
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(15));
    dot_q8_0_codes<MT>(_mm256_sub_epi8(q, _mm256_set1_epi8(8)), q8_f16(b), x, xrow, acc);
  }
}


// W row n against the x rows [m0, m0 + MT)
template <int TYPE, int MT>
void group_q8(const Args& a, const uint8_t* xq, int64_t xrow, int64_t n, int64_t m0) {
  constexpr int wb = block_bytes(TYPE), xb = block_weights(TYPE) == 32 ? sizeof(BlockQ8_0) : sizeof(BlockQ8K);
  const int64_t nb = a.K / block_weights(TYPE);
  __m256 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* w = a.w + n * a.row_bytes;
  const uint8_t* x = xq + m0 * xrow;
  for (int64_t i = 0; i < nb; ++i) {
    for (int off = 0; off < wb; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + i * wb + kPrefetchAhead + off), _MM_HINT_T0);
    dot_block<TYPE, MT>(w + i * wb, x + i * xb, xrow, acc);
  }
  const float bias = a.bias ? a.bias[n] : 0.f;
  for (int r = 0; r < MT; ++r) a.y[(m0 + r) * a.N + n] = hsum(acc[r]) + bias;
}

template <int TYPE>
void rows_q8_of(const Args& a, const uint8_t* xq, int64_t n0, int64_t n1) {
  constexpr int R = Q8Isa::kRows;
  const int64_t xrow = x_row_bytes(TYPE, a.K);
  for (int64_t n = n0; n < n1; ++n) {
    int64_t m = 0;
    for (; m + R <= a.M; m += R) group_q8<TYPE, R>(a, xq, xrow, n, m);
    if constexpr (R > 4) {
      if (a.M - m >= 4) group_q8<TYPE, 4>(a, xq, xrow, n, m), m += 4;
    }
    if (a.M - m >= 2) group_q8<TYPE, 2>(a, xq, xrow, n, m), m += 2;
    if (a.M - m >= 1) group_q8<TYPE, 1>(a, xq, xrow, n, m);
  }
}

}  // namespace

void quantize_x(const Args& a, void* xq, int64_t m0, int64_t m1) {
  const int64_t xrow = x_row_bytes(a.type, a.K);
  for (int64_t m = m0; m < m1; ++m) {
    uint8_t* y = static_cast<uint8_t*>(xq) + m * xrow;
    if (x_type(a.type) == kXQ8_0)
      quantize_q8_0(a.x + m * a.K, a.K, reinterpret_cast<BlockQ8_0*>(y));
    else
      quantize_q8_k(a.x + m * a.K, a.K, reinterpret_cast<BlockQ8K*>(y));
  }
}

void rows_q8(const Args& a, const void* xq_in, int64_t n0, int64_t n1) {
  const auto* xq = static_cast<const uint8_t*>(xq_in);
  switch (a.type) {
    case kQ8_0: rows_q8_of<kQ8_0>(a, xq, n0, n1); break;
    case kQ4_0: rows_q8_of<kQ4_0>(a, xq, n0, n1); break;
    case kQ4_K: rows_q8_of<kQ4_K>(a, xq, n0, n1); break;
    case kQ5_K: rows_q8_of<kQ5_K>(a, xq, n0, n1); break;
    default: rows_q8_of<kQ6_K>(a, xq, n0, n1); break;
  }
}
