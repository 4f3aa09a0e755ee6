// AVX2 + FMA instance of the block GEMM (quant_tile.h): 8 lanes.
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "quant_blocks.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace kvstate::quant::avx2 {

struct Isa {
  using V = __m256;
  using VI = __m256i;
  static constexpr int L = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V cvt(VI v) { return _mm256_cvtepi32_ps(v); }
  static float reduce(V v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }
  // a value the compiler may not fuse into the next operation (an FMA would round differently)
  static void keep(V& v) { __asm__("" : "+x"(v)); }
  static VI u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static VI i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static VI iset1(int v) { return _mm256_set1_epi32(v); }
  static VI isub(VI a, VI b) { return _mm256_sub_epi32(a, b); }
  static VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
  static VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
  static VI srl(VI a, int n) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(n)); }
  static VI sll(VI a, int n) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(n)); }
  // 8 lanes hold no 16-entry table: the codes are converted and scaled instead (quant_tile.h)
  static constexpr int kTileRows = 2;  // 4 W rows x 2 x rows: 8 accumulators + 4 W + 1 x registers
  static constexpr bool kLut = false;
  static VI iota(int) { return _mm256_setzero_si256(); }
  static V lut16(VI, V t) { return t; }
  static V lut32(VI, V t, V) { return t; }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  // 16 entries in two registers: each half looked up by the index's low 3 bits, bit 3 picks the half
  static V table16(VI idx, const V* t) {
    const V lo = _mm256_permutevar8x32_ps(t[0], idx), hi = _mm256_permutevar8x32_ps(t[1], idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
  }
};

#include "quant_tile.h"

}  // namespace kvstate::quant::avx2

#pragma GCC pop_options
