// AVX512_BF16 instance of the skinny GEMM for bf16 weights (Zen 4, Cooper Lake; only called when the
// CPU reports avx512_bf16). vdpbf16ps multiplies bf16 pairs exactly and adds both products into an
// fp32 lane, so a W row is used as loaded, with no widening. x is given as P bf16 parts per element
// (x ~ p0 + p1 + ...): P = 1 rounds the activations to bf16, as llama.cpp's bf16 path does (the opt-in
// `activation_dtype="bf16"`); P = 2 or 3 splits x (16 or 24 significant bits) for a near-exact sum.
// The instruction flushes denormal inputs and results to zero, and its sum order differs from the
// fp32 path's: these modes are close to exact math, not bit-equal to it.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "gemv.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

namespace kvstate::avx512bf16 {

namespace {

using V = __m512;

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// The W vector of 32 bf16 at p (rem < 32: the first rem, the rest zero).
template <bool TAIL>
inline __attribute__((always_inline)) __m512i wload(const uint16_t* p, int rem) {
  if constexpr (TAIL) return _mm512_maskz_loadu_epi16(__mmask32((1ull << rem) - 1), p);
  return _mm512_loadu_si512(p);
}

// acc[m][r] += W[r, k:k+32] . x[m, k:k+32] over P parts of x. The R W vectors stay in registers; each x
// part is loaded once for R dot products.
template <int R, int MT, int P, bool TAIL>
inline __attribute__((always_inline)) void step(const uint16_t* w, int64_t K, const uint16_t* x, int64_t Kp,
                                                int64_t k, int rem, V (&acc)[MT][R]) {
  __m512i wv[R];
  for (int r = 0; r < R; ++r) wv[r] = wload<TAIL>(w + r * K + k, rem);
  for (int m = 0; m < MT; ++m)
    for (int p = 0; p < P; ++p) {
      const __m512i xv = _mm512_loadu_si512(x + (m * Kp + k) * P + p * 32);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], as_bh(wv[r]), as_bh(xv));
    }
}

// y[m0 + m, n + r] for the R x MT tile over all of K; the next block's lines are prefetched as the
// step walks this one. Up to 4 x rows, one line per row every other 32-element step (64 bytes of
// bf16; the hardware fetches the other one, and all of them ran slower); more rows, every line: the
// tile then computes long enough per line that a missing one stalls it (8 rows, Zen 5: 45 -> 29 ms
// over 1 GB of weights, the memory time of one row).
template <int R, int MT, int P>
void tile(const GemvBf16Args& a, int64_t n, int64_t m0, int64_t rb) {
  V acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const uint16_t* w = a.w + n * a.K;
  const uint16_t* x = a.x + m0 * a.Kp * P;
  const char* ahead = reinterpret_cast<const char*>(a.w + (n + rb) * a.K);
  const bool last_block = n + rb >= a.N;
  const int64_t kfull = a.K / 32 * 32;
  for (int64_t k = 0; k < kfull; k += 32) {
    if (!last_block && (MT > 4 || (k & 32) == 0))
      for (int r = 0; r < R; ++r) _mm_prefetch(ahead + (r * a.K + k) * 2, _MM_HINT_NTA);
    step<R, MT, P, false>(w, a.K, x, a.Kp, k, 0, acc);
  }
  if (kfull < a.K) step<R, MT, P, true>(w, a.K, x, a.Kp, kfull, int(a.K - kfull), acc);
  for (int m = 0; m < MT; ++m) {
    float* yrow = a.y + (m0 + m) * a.N + n;
    for (int r = 0; r < R; ++r) yrow[r] = _mm512_reduce_add_ps(acc[m][r]) + (a.bias ? a.bias[n + r] : 0.f);
  }
}

using TileFn = void (*)(const GemvBf16Args&, int64_t, int64_t, int64_t);

// fn[r - 1][mt - 1] for r <= 4, mt <= 8 (a 4 x 8 tile is never run: see rows)
template <int P>
struct Table {
  TileFn fn[4][8];
  Table() { fill<1>(); }
  template <int R>
  void fill() {
    if constexpr (R <= 4) {
      fill_cols<R>(std::make_integer_sequence<int, 8>{});
      fill<R + 1>();
    }
  }
  template <int R, int... J>
  void fill_cols(std::integer_sequence<int, J...>) {
    ((fn[R - 1][J] = &tile<R, J + 1, P>), ...);
  }
};

template <int P>
const char* rows_parts(const GemvBf16Args& a, int64_t n0, int64_t n1) {
  static const Table<P> table;
  // 1-4 x rows: 4 W rows x M (the x vectors are few); 5 and more: 3 W rows x 8 x rows per pass
  // (24 accumulators + 3 W + 1 x of 32 registers), the W block re-read from L1 by later passes.
  const int RB = a.M <= 4 ? 4 : 3, MTB = a.M <= 4 ? 4 : 8;
  for (int64_t n = n0; n < n1; n += RB) {
    const int r = int(std::min<int64_t>(RB, n1 - n));
    for (int64_t m0 = 0; m0 < a.M; m0 += MTB) {
      const int mt = int(std::min<int64_t>(MTB, a.M - m0));
      table.fn[r - 1][mt - 1](a, n, m0, RB);
    }
  }
  return a.M <= 4 ? "bf16dp 4x4" : "bf16dp 3x8";
}

}  // namespace

// x [M, K] fp32 -> xb [M, Kp / 32][P][32] bf16, zero-padded to Kp: part p is the bf16 (round to
// nearest even) of what parts 0..p-1 left over.
void prepare_x(const float* x, int64_t M, int64_t K, int64_t Kp, int parts, uint16_t* xb) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < Kp; k += 32) {
      const int rem = int(std::clamp<int64_t>(K - k, 0, 32));
      const __mmask16 lo = __mmask16(rem >= 16 ? 0xFFFF : (1u << rem) - 1);
      const __mmask16 hi = __mmask16(rem <= 16 ? 0 : rem >= 32 ? 0xFFFF : (1u << (rem - 16)) - 1);
      V a = _mm512_maskz_loadu_ps(lo, x + m * K + k), b = _mm512_maskz_loadu_ps(hi, x + m * K + k + 16);
      uint16_t* dst = xb + (m * Kp + k) * parts;
      for (int p = 0; p < parts; ++p) {
        // cvtne2ps: the second operand fills the low 16 lanes
        const __m512bh v = _mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(dst + p * 32, reinterpret_cast<__m512i>(v));
        const __m512i wide_lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(
                                                      reinterpret_cast<__m512i>(v))), 16);
        const __m512i wide_hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(
                                                      reinterpret_cast<__m512i>(v), 1)), 16);
        a = _mm512_sub_ps(a, _mm512_castsi512_ps(wide_lo));
        b = _mm512_sub_ps(b, _mm512_castsi512_ps(wide_hi));
      }
    }
}

const char* rows(const GemvBf16Args& a, int64_t n0, int64_t n1) {
  if (a.parts == 1) return rows_parts<1>(a, n0, n1);
  return a.parts == 2 ? rows_parts<2>(a, n0, n1) : rows_parts<3>(a, n0, n1);
}

}  // namespace kvstate::avx512bf16

#pragma GCC pop_options
