// AVX2 instance of the "q8" kernels (quant_q8_tile.h): vpmaddubsw / vpmaddwd, then an add.
#include <immintrin.h>

#include <cstdint>

#include "quant_blocks.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace kvstate::quant::avx2 {

namespace {
struct Q8Isa {
  static constexpr int kRows = 4;  // 4 int + 4 float accumulators of 16 registers
  static __m256i dot_us(__m256i acc, __m256i u, __m256i s) {
    // |u| <= 128, |s| <= 127: the pairs of vpmaddubsw stay within int16
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static __m256i dot_scaled(__m256i acc, __m256i p, __m256i sc) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
  }
  static constexpr bool kWideK = false;
};
}  // namespace

#include "quant_q8_tile.h"

}  // namespace kvstate::quant::avx2

#pragma GCC pop_options
