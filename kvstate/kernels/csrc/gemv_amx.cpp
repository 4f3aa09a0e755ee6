// AMX instance of the skinny GEMM for bf16 weights (fp32 weights take the AVX-512 path).
//
// AMX multiplies bf16 tiles into fp32 accumulators, so x is split exactly enough into three bf16
// parts, x = hi + mid + lo (8 + 8 + 8 significant bits, the 24 of fp32), and all three are
// accumulated into the same tile: every product bf16 x bf16 is exact in fp32, the sums are fp32,
// so the result is the fp32 math of the other paths (up to summation order). The weights are the
// A operand straight from their row-major [N, K] storage (16 rows x 32 k per tile); x parts are
// the B operand, pre-laid out [K/2][M][2]. Compute is then ~3 instructions per 1 KiB of weights
// for any M <= 16: the step streams weights at memory speed whatever the batch.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemv.h"

namespace kvstate::amx {

namespace {
// Linux gives a process AMX state only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
bool request_amx() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

inline float bf16_value(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
}  // namespace

bool usable() {
  static const bool ok = request_amx();
  return ok;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw")

// In-register transpose of a 16 x 16 matrix of 32-bit words (r[i] = row i).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// x [M, K] -> xb [3][K32 / 2][M][2] bf16 parts (K32 = K rounded down to 32; the rest of K is
// done in scalar code by rows()). Truncating to bf16 makes each part and each remainder exact:
// hi = top 8 bits of x, mid = top 8 bits of x - hi, lo = the rest (x = hi + mid + lo).
void prepare_x(const float* x, int64_t M, int64_t K, uint16_t* xb) {
  const int64_t K32 = K / 32 * 32, part = K32 * M;
  const __m512i top = _mm512_set1_epi32(int(0xFFFF0000u));
  // 16-bit lanes 1, 3, 5, ..., 63 of two vectors: the bf16 halves of 32 floats, in order, so
  // 32-bit word j holds the pair (k + 2j, k + 2j + 1).
  alignas(64) int16_t odd_lanes[32];
  for (int t = 0; t < 32; ++t) odd_lanes[t] = int16_t(2 * t + 1);
  const __m512i pick = _mm512_load_si512(odd_lanes);
  const __mmask16 keep = __mmask16((1u << M) - 1);
  for (int64_t k = 0; k < K32; k += 32) {
    __m512 words[3][16];  // [part][m] -> 16 pairs of this k block
    for (int64_t m = 0; m < 16; ++m) {
      if (m >= M) {
        for (int q = 0; q < 3; ++q) words[q][m] = _mm512_setzero_ps();
        continue;
      }
      __m512i p[2][3];
      for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_loadu_ps(x + m * K + k + 16 * h);
        const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
        const __m512 r1 = _mm512_sub_ps(v, hi);
        const __m512 mid = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r1), top));
        p[h][0] = _mm512_castps_si512(hi);
        p[h][1] = _mm512_castps_si512(mid);
        p[h][2] = _mm512_castps_si512(_mm512_sub_ps(r1, mid));
      }
      for (int q = 0; q < 3; ++q) words[q][m] = _mm512_castsi512_ps(_mm512_permutex2var_epi16(p[0][q], pick, p[1][q]));
    }
    for (int q = 0; q < 3; ++q) {
      float* out = reinterpret_cast<float*>(xb + q * part) + (k / 2) * M;  // [16 pairs][M] words
      if (M == 1) {
        _mm512_storeu_ps(out, words[q][0]);
        continue;
      }
      transpose16(words[q]);  // words[q][j] = pair j of every row m
      for (int j = 0; j < 16; ++j) _mm512_mask_storeu_ps(out + j * M, keep, words[q][j]);
    }
  }
}

// y[:, n0:n1] for n1 - n0 a multiple of 32 (the caller gives the rest to the AVX-512 path).
void rows(const AmxArgs& a, int64_t n0, int64_t n1) {
  const int64_t M = a.M, K = a.K, K32 = K / 32 * 32, part = K32 * M;
  TileConfig cfg;
  for (int t : {0, 1, 4, 5, 6}) cfg.rows[t] = 16, cfg.colsb[t] = uint16_t(4 * M);  // C: 16 n x M; B: 16 kp x M x 2
  for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 64;                      // A: 16 n x 32 k
  _tile_loadconfig(&cfg);
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  const int64_t ldw = K * 2;  // bytes
  float c[32 * 16];
  for (int64_t nb = n0; nb < n1; nb += 32) {
    const uint16_t* w0 = w + nb * K;
    const uint16_t* w1 = w0 + 16 * K;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < K32; k += 32) {
      for (int r = 0; r < 16; ++r) {  // 32 row streams: more than the hardware prefetchers follow
        _mm_prefetch(reinterpret_cast<const char*>(w0 + r * K + k) + 1024, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w1 + r * K + k) + 1024, _MM_HINT_T0);
      }
      _tile_loadd(2, w0 + k, ldw);
      _tile_loadd(3, w1 + k, ldw);
      const uint16_t* b = a.xb + (k / 2) * M * 2;
      _tile_loadd(4, b, 4 * M);
      _tile_loadd(5, b + part, 4 * M);
      _tile_loadd(6, b + 2 * part, 4 * M);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
      _tile_dpbf16ps(0, 2, 5);
      _tile_dpbf16ps(1, 3, 5);
      _tile_dpbf16ps(0, 2, 6);
      _tile_dpbf16ps(1, 3, 6);
    }
    _tile_stored(0, c, 4 * M);           // c[i][m] = sum for W row nb + i
    _tile_stored(1, c + 16 * M, 4 * M);  // rows nb + 16 + i
    for (int i = 0; i < 32; ++i) {
      const uint16_t* wr = w + (nb + i) * K;
      for (int64_t m = 0; m < M; ++m) {
        float s = c[i * M + m];
        const float* xr = a.x + m * K;
        for (int64_t k = K32; k < K; ++k) s += bf16_value(wr[k]) * xr[k];
        a.y[m * a.N + nb + i] = s + (a.bias ? a.bias[nb + i] : 0.f);
      }
    }
  }
  _tile_release();
}

#pragma GCC pop_options

}  // namespace kvstate::amx
