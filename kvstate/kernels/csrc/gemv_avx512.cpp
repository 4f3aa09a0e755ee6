// AVX-512 (F + BW) instance of the skinny GEMM; only called when the CPU reports both.
// AVX-512 BF16's dot-product instruction is not used on purpose: it takes x in bf16 too, which
// would round the activations; here bf16 weights are widened exactly and the math stays fp32.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "gemv.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")

namespace kvstate::avx512 {

struct Isa {
  using V = __m512;
  using Raw = __m512i;
  static constexpr int L = kLanes;
  // The register tile per row class (gemv.h). fp32 weights at 5-8 rows: 3 W rows x 8 x rows, W in
  // registers (24 accumulators + 3 W + 1 x of 32), each x vector loaded once for 3 FMAs and the W
  // block read once per step: faster than 4 x 4 at 5-8 rows, even or behind at 3-4 and 12-32
  // (docs/benchmarks.md, "Kernel history"). Otherwise 4 W rows x 4 x rows: 16 accumulators + 8 x vectors + 3 temporaries.
  template <bool BF16, int ROWS>
  struct Plan {
    static constexpr bool k3x8 = ROWS == kMidRows && !BF16;
    static constexpr int R = k3x8 ? 3 : 4, MT = k3x8 ? 8 : 4;
    static constexpr bool kWregs = k3x8;
    static constexpr const char* name = k3x8 ? "3x8" : "4x4";
  };
  static V zero() { return _mm512_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  // An x vector stays in its register for the tile's R FMAs: without this the compiler folds the
  // load into each FMA (R loads instead of one: the 3 x 8 tile then runs out of load slots).
  static void keep(V& v) { __asm__("" : "+v"(v)); }
  static float reduce(V v) { return _mm512_reduce_add_ps(v); }
  static V wf32(const float* p) { return _mm512_loadu_ps(p); }
  static V wf32_tail(const float* p, int rem) { return _mm512_maskz_loadu_ps(__mmask16((1u << rem) - 1), p); }
  // 16 int8 weights, sign-extended and converted: exact (|q| <= 127)
  static V wi8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V wi8_tail(const int8_t* p, int rem) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(__mmask16((1u << rem) - 1), p)));
  }
  static Raw wbf16(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Raw wbf16_tail(const uint16_t* p, int rem) {
    return _mm512_maskz_loadu_epi16(__mmask32((1ull << rem) - 1), p);
  }
  static V even(Raw r) { return _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)); }
  static V odd(Raw r) { return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(int(0xFFFF0000u)))); }
  static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
  // src[0:32] -> dst[0:16] = even elements, dst[16:32] = odd ones.
  static void deinterleave(const float* src, float* dst) {
    const V a = _mm512_loadu_ps(src), b = _mm512_loadu_ps(src + L);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    _mm512_storeu_ps(dst, _mm512_permutex2var_ps(a, even, b));
    _mm512_storeu_ps(dst + L, _mm512_permutex2var_ps(a, odd, b));
  }
};

#include "gemv_tile.h"

}  // namespace kvstate::avx512

#pragma GCC pop_options
