// x's side of the AMX GEMV (gemv_amx.cpp): fp32 x split exactly into three bf16 parts and laid out
// as the B tiles read it.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gemv.h"

namespace kvstate::amx {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw")

#include "gemv_amx_transpose.h"

// x [M, K] -> xb [K32 / 2][3][M][2] bf16 parts (K32 = K rounded down to 32; the rest of K is
// done in scalar code by rows()): row p of a B tile is k pair p of every part and x row, 3 M
// 32-bit words. Truncating to bf16 makes each part and each remainder exact: hi = top 8 bits of
// x, mid = top 8 bits of x - hi, lo = the rest (x = hi + mid + lo).
void prepare_x(const float* x, int64_t M, int64_t K, uint16_t* xb) {
  const int64_t K32 = K / 32 * 32;
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  // 16-bit lanes 1, 3, 5, ..., 63 of two vectors: the bf16 halves of 32 floats, in order, so
  // 32-bit word j holds the pair (k + 2j, k + 2j + 1).
  alignas(64) int16_t odd_lanes[32];
  for (int t = 0; t < 32; ++t) odd_lanes[t] = int16_t(2 * t + 1);
  const __m512i pick = _mm512_load_si512(odd_lanes);
  for (int64_t m0 = 0; m0 < M; m0 += 16) {  // 16 rows of x at a time: one 16 x 16 transpose
    const int64_t mb = std::min<int64_t>(16, M - m0);
    const __mmask16 keep = __mmask16((1u << mb) - 1);
    for (int64_t k = 0; k < K32; k += 32) {
      __m512 words[3][16];  // [part][m] -> 16 pairs of this k block
      for (int64_t i = 0; i < 16; ++i) {
        if (m0 + i >= M) {
          for (int q = 0; q < 3; ++q) words[q][i] = _mm512_setzero_ps();
          continue;
        }
        __m512i p[2][3];
        for (int h = 0; h < 2; ++h) {
          const __m512 v = _mm512_loadu_ps(x + (m0 + i) * K + k + 16 * h);
          const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
          const __m512 r1 = _mm512_sub_ps(v, hi);
          const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), top));
          p[h][0] = _mm512_castps_si512(hi);
          p[h][1] = _mm512_castps_si512(mid);
          p[h][2] = _mm512_castps_si512(_mm512_sub_ps(r1, mid));
        }
        for (int q = 0; q < 3; ++q)
          words[q][i] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(p[0][q], pick, p[1][q]));
      }
      for (int q = 0; q < 3; ++q) {
        float* out = reinterpret_cast<float*>(xb) + (k / 2) * 3 * M + q * M + m0;  // [16 pairs][3][M] words
        transpose16(words[q]);  // words[q][j] = pair j of rows m0..m0+15
        for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(out + j * 3 * M, keep, words[q][j]);
      }
    }
  }
}

#pragma GCC pop_options

}  // namespace kvstate::amx
