// AVX-512 VNNI instance of the "q8" kernels (quant_q8_tile.h): vpdpbusd / vpdpwssd, each fusing a
// multiply, the pairwise sums and the accumulation; the K-quants in 512-bit vectors (quant_q8_wide.h),
// Q8_0 / Q4_0 in 256-bit ones (AVX512_VL).
#include <immintrin.h>

#include <cstdint>

#include "quant_blocks.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

namespace kvstate::quant::avx512 {

namespace {
struct Q8Isa {
  static constexpr int kRows = 8;  // 8 int + 8 float accumulators of 32 registers
  static __m256i dot_us(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static __m256i dot_scaled(__m256i acc, __m256i p, __m256i sc) { return _mm256_dpwssd_epi32(acc, p, sc); }
  static constexpr bool kWideK = true;  // the K-quants in 512-bit vectors (quant_q8_wide.h)
  template <int TYPE, int MT>
  static void kquant(const uint8_t* b, const uint8_t* x, int64_t xrow, __m256* acc);
};
}  // namespace

#include "quant_q8_tile.h"
#include "quant_q8_wide.h"

}  // namespace kvstate::quant::avx512

#pragma GCC pop_options
