// AVX2 + FMA instance of the skinny GEMM: the path for CPUs without AVX-512 (and forced in
// tests on CPUs with it). 16 vector registers: 4 W rows x 2 x rows for 1-2 rows; for more fp32
// rows, 3 x 4 with the W vectors in registers (12 accumulators + 3 W + 1 x), faster than 4 x 2 there.
// bf16 weights keep 4 x 2: with two W registers a row a wider tile runs out of registers
// (docs/benchmarks.md, "Kernel history").
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "gemv.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace kvstate::avx2 {

struct Isa {
  using V = __m256;
  using Raw = __m256i;
  static constexpr int L = kLanes;
  // The register tile (R W rows x MT x rows) for few (M <= 2) or more rows of x.
  template <bool BF16, int ROWS>
  struct Plan {
    static constexpr bool k3x4 = ROWS != kFewRows && !BF16;
    static constexpr int R = k3x4 ? 3 : 4;
    static constexpr int MT = k3x4 ? 4 : 2;
    static constexpr bool kWregs = k3x4;
    static constexpr const char* name = k3x4 ? "3x4" : "4x2";
  };
  static V zero() { return _mm256_setzero_ps(); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void keep(V&) {}  // (measured with the compiler's own choice; see the AVX-512 Isa)
  static float reduce(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(_mm_hadd_ps(s, s));
  }
  static V wf32(const float* p) { return _mm256_loadu_ps(p); }
  // AVX2 has no 16-bit masked load: the (once per row and tile) tail goes through a zeroed buffer.
  static V wf32_tail(const float* p, int rem) {
    float b[L] = {};
    std::memcpy(b, p, size_t(rem) * sizeof(float));
    return _mm256_loadu_ps(b);
  }
  static V wi8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V wi8_tail(const int8_t* p, int rem) {
    int8_t b[L] = {};
    std::memcpy(b, p, size_t(rem));
    return wi8(b);
  }
  static Raw wbf16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static Raw wbf16_tail(const uint16_t* p, int rem) {
    uint16_t b[2 * L] = {};
    std::memcpy(b, p, size_t(rem) * sizeof(uint16_t));
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  }
  static V even(Raw r) { return _mm256_castsi256_ps(_mm256_slli_epi32(r, 16)); }
  static V odd(Raw r) { return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(int(0xFFFF0000u)))); }
  // Non-temporal: the weights pass through L1 without displacing what the rest of the step keeps
  // in L2/L3 (activations, norm weights, the interpreter's own data): faster than T0 at 1 row,
  // even at 8 (docs/benchmarks.md).
  static void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_NTA); }
  // src[0:16] -> dst[0:8] = even elements, dst[8:16] = odd ones.
  static void deinterleave(const float* src, float* dst) {
    const V a = _mm256_loadu_ps(src), b = _mm256_loadu_ps(src + L);
    // shuffle_ps works per 128-bit lane: [a0 a2 b0 b2 | a4 a6 b4 b6]; then order the 64-bit pairs.
    const V e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    _mm256_storeu_ps(dst, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0))));
    _mm256_storeu_ps(dst + L, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0))));
  }
};

#include "gemv_tile.h"

}  // namespace kvstate::avx2

#pragma GCC pop_options
