// AVX512_BF16 GEMM for the many x rows of a prefill (bf16 weights; only called when the CPU reports
// avx512_bf16). y = x W^T (+ bias) with fp32 sums and an fp32 output; x in 1 bf16 part (rounded: the
// opt-in `activation_dtype="bf16"`) or 3 (split, 24 significant bits: the exact mode's prefill, as
// the AMX kernel does it).
//
// The skinny kernel (gemv_avx512bf16.cpp) keeps a dot product per output in the lanes of one register
// and reduces it at the end; with hundreds of x rows that reduction and its x traffic cost more than
// the products. Here each register holds 16 output columns of one x row (the BLAS outer-product
// form): a 6 x 64 tile of y takes 24 accumulators; each step of 2 k loads 4 vectors of W (16 columns
// x 2 k, packed) and broadcasts one 32-bit (k, k+1) pair of x per row, 24 vdpbf16ps for 10 loads.
// W is packed per 64 columns x kKC of k (32 KiB, in L1 for all M rows); x [M, Kp] in bf16 streams
// from L2/L3 at a small fraction of its bandwidth.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "gemv.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

namespace kvstate::avx512bf16 {

namespace {

constexpr int kNV = kGemmCols / 16;  // vectors of 16 output columns in a tile
constexpr int kMR = 6;               // x rows in a tile: 6 x 4 = 24 accumulators of 32 registers
constexpr int64_t kKC = 256;         // k per W panel: 64 columns x 256 bf16 = 32 KiB

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// r[i] (16 words of row i) -> r[c] (word c of rows 0..15): the 16 x 16 transpose of 32-bit words.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + q], 128-bit lane l: rows 4g..4g+3 of word 4l + q
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i w0 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x44), w1 = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xEE);
    const __m512i w2 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x44);
    const __m512i w3 = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xEE);
    r[q] = _mm512_shuffle_i32x4(w0, w2, 0x88);
    r[4 + q] = _mm512_shuffle_i32x4(w0, w2, 0xDD);
    r[8 + q] = _mm512_shuffle_i32x4(w1, w3, 0x88);
    r[12 + q] = _mm512_shuffle_i32x4(w1, w3, 0xDD);
  }
}

// wp[j][c] (j < kc / 2, c < 64): the 32-bit pair W[n0 + c, k0 + 2j .. k0 + 2j + 1], zero past N and K.
void pack_w(const GemvBf16Args& a, int64_t n0, int64_t k0, int64_t kc, uint32_t* wp) {
  for (int64_t c0 = 0; c0 < kGemmCols; c0 += 16)
    for (int64_t kk = 0; kk < kc; kk += 32) {
      const int64_t rem = std::clamp<int64_t>(a.K - (k0 + kk), 0, 32);
      const __mmask32 mask = rem == 32 ? ~__mmask32(0) : __mmask32((1ull << rem) - 1);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = n0 + c0 + i;
        r[i] = n < a.N ? _mm512_maskz_loadu_epi16(mask, a.w + n * a.K + k0 + kk) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(wp + (kk / 2 + j) * kGemmCols + c0, r[j]);
    }
}

// y[m0 .. m0 + MR, n0 .. n0 + 64] (columns masked by `cols`) += x[rows, k0 : k0 + kc] . wp, x in P bf16
// parts; FIRST: the first panel of k (y is not read); LAST: the last (the bias is added).
template <int MR, int P, bool FIRST, bool LAST>
void tile(const GemvBf16Args& a, const uint32_t* wp, int64_t m0, int64_t n0, int64_t k0, int64_t kc,
          const __mmask16 (&cols)[kNV]) {
  __m512 acc[MR][kNV];
  float* y = a.y + m0 * a.N + n0;
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v)
      acc[m][v] = FIRST ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(cols[v], y + m * a.N + 16 * v);
  // x [M, Kp / 32, P, 32] bf16 as 32-bit (k, k + 1) pairs: row m's block b, part p, pair i at
  // xw[m * ldx + b * 16 * P + p * 16 + i]
  const uint32_t* xw = reinterpret_cast<const uint32_t*>(a.x + (m0 * a.Kp + k0) * P);
  const int64_t ldx = a.Kp * P / 2;
  for (int64_t b = 0; b < kc / 32; ++b)
    for (int i = 0; i < 16; ++i) {
      const int64_t j = b * 16 + i;
      __m512i wv[kNV];
      for (int v = 0; v < kNV; ++v) wv[v] = _mm512_load_si512(wp + j * kGemmCols + 16 * v);
      for (int m = 0; m < MR; ++m)
        for (int p = 0; p < P; ++p) {
          const __m512i xv = _mm512_set1_epi32(int(xw[m * ldx + b * 16 * P + p * 16 + i]));
          for (int v = 0; v < kNV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], as_bh(wv[v]), as_bh(xv));
        }
    }
  if (LAST && a.bias)
    for (int v = 0; v < kNV; ++v) {
      const __m512 bias = _mm512_maskz_loadu_ps(cols[v], a.bias + n0 + 16 * v);
      for (int m = 0; m < MR; ++m) acc[m][v] = _mm512_add_ps(acc[m][v], bias);
    }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kNV; ++v) _mm512_mask_storeu_ps(y + m * a.N + 16 * v, cols[v], acc[m][v]);
}

using TileFn = void (*)(const GemvBf16Args&, const uint32_t*, int64_t, int64_t, int64_t, int64_t,
                        const __mmask16 (&)[kNV]);

// fn[first][last][mr - 1] for x in P parts
template <int P>
struct Table {
  TileFn fn[2][2][kMR];
  Table() { fill(std::make_integer_sequence<int, kMR>{}); }
  template <int... I>
  void fill(std::integer_sequence<int, I...>) {
    ((fn[0][0][I] = &tile<I + 1, P, false, false>), ...);
    ((fn[0][1][I] = &tile<I + 1, P, false, true>), ...);
    ((fn[1][0][I] = &tile<I + 1, P, true, false>), ...);
    ((fn[1][1][I] = &tile<I + 1, P, true, true>), ...);
  }
};

template <int P>
void gemm_parts(const GemvBf16Args& a, int64_t n0, int64_t n1) {
  static const Table<P> table;
  alignas(64) static thread_local uint32_t wp[kKC / 2 * kGemmCols];
  for (int64_t n = n0; n < n1; n += kGemmCols) {
    __mmask16 cols[kNV];
    for (int v = 0; v < kNV; ++v) {
      const int64_t left = std::clamp<int64_t>(std::min(n1, a.N) - n - 16 * v, 0, 16);
      cols[v] = __mmask16((1u << left) - 1);
    }
    for (int64_t k0 = 0; k0 < a.Kp; k0 += kKC) {
      const int64_t kc = std::min(kKC, a.Kp - k0);  // a multiple of 32, as Kp is
      pack_w(a, n, k0, kc, wp);
      const bool first = k0 == 0, last = k0 + kc >= a.Kp;
      // the next panel's W lines (the next k, else the next 64 columns' first k), spread over this
      // panel's tiles: packing reads 64 rows at once, which the hardware prefetchers do not follow
      const int64_t nn = last ? n + kGemmCols : n, nk = last ? 0 : k0 + kc;
      const int64_t lines = nn < std::min(n1, a.N) ? kGemmCols * std::min(kKC, a.Kp - nk) / 32 : 0;
      const int64_t tiles = (a.M + kMR - 1) / kMR;
      for (int64_t m = 0, t = 0; m < a.M; m += kMR, ++t) {
        const int mr = int(std::min<int64_t>(kMR, a.M - m));
        table.fn[first][last][mr - 1](a, wp, m, n, k0, kc, cols);
        for (int64_t l = lines * t / tiles; l < lines * (t + 1) / tiles; ++l) {
          const int64_t row = std::min(nn + l % kGemmCols, a.N - 1), k = std::min(nk + l / kGemmCols * 32, a.K - 1);
          _mm_prefetch(reinterpret_cast<const char*>(a.w + row * a.K + k), _MM_HINT_T0);
        }
      }
    }
  }
}

}  // namespace

void gemm(const GemvBf16Args& a, int64_t n0, int64_t n1) {
  if (a.Kp == 0) {  // K = 0: y is the bias (or zero)
    for (int64_t m = 0; m < a.M; ++m)
      for (int64_t n = n0; n < std::min(n1, a.N); ++n) a.y[m * a.N + n] = a.bias ? a.bias[n] : 0.f;
    return;
  }
  if (a.parts == 1)
    gemm_parts<1>(a, n0, n1);
  else
    gemm_parts<3>(a, n0, n1);
}

}  // namespace kvstate::avx512bf16

#pragma GCC pop_options
