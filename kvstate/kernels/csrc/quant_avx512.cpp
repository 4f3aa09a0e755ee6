// AVX-512 instance of the block GEMM (quant_tile.h): 16 lanes.
#include <immintrin.h>

#include <cstdint>
#include <vector>

#include "quant_blocks.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace kvstate::quant::avx512 {

struct Isa {
  using V = __m512;
  using VI = __m512i;
  static constexpr int L = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V cvt(VI v) { return _mm512_cvtepi32_ps(v); }
  static float reduce(V v) { return _mm512_reduce_add_ps(v); }
  // a value the compiler may not fuse into the next operation (an FMA would round differently)
  static void keep(V& v) { __asm__("" : "+v"(v)); }
  static VI u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VI i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static VI iset1(int v) { return _mm512_set1_epi32(v); }
  static VI isub(VI a, VI b) { return _mm512_sub_epi32(a, b); }
  static VI and_(VI a, VI b) { return _mm512_and_si512(a, b); }
  static VI or_(VI a, VI b) { return _mm512_or_si512(a, b); }
  static VI srl(VI a, int n) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(n)); }
  static VI sll(VI a, int n) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(n)); }
  // table lookups of floats by int32 index: 16 entries, or 32 (bit 4 picks the second table)
  static constexpr int kTileRows = 4;  // 4 W rows x 4 x rows: 16 accumulators + 4 W + 1 x registers
  static constexpr bool kLut = true;
  static VI iota(int base) {
    return _mm512_add_epi32(_mm512_set1_epi32(base), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static V lut16(VI idx, V t) { return _mm512_permutexvar_ps(idx, t); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static V table16(VI idx, const V* t) { return _mm512_permutexvar_ps(idx, t[0]); }
  static V lut32(VI idx, V t, V u) { return _mm512_permutex2var_ps(t, idx, u); }
};

#include "quant_tile.h"

}  // namespace kvstate::quant::avx512

#pragma GCC pop_options
