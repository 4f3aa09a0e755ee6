// AMX instance of the skinny GEMM for bf16 weights, and int8 ones widened to bf16 as they are staged
// (exact: |q| <= 127; each row's sum is then multiplied by its scale). fp32 weights take AVX-512.
//
// AMX multiplies bf16 tiles into fp32 accumulators, so x is split exactly enough into three bf16
// parts, x = hi + mid + lo (8 + 8 + 8 significant bits, the 24 of fp32), and all three are
// accumulated: every product bf16 x bf16 is exact in fp32, the sums are fp32, so the result is
// the fp32 math of the other paths (up to summation order). The weights are the A operand (16
// rows x 32 k per tile), x parts the B operand, pre-laid out [K/2][3][M][2]. Up to 10 rows the 3 M
// (part, row) columns share one or two B tiles (2 or 4 tile products per 32 W rows and 32 k
// instead of 6); one pass over the weights serves up to 32 rows of x (two C tiles per 16 W rows);
// more rows re-read each block of 32 W rows from L2, so the weights stream from memory once for any M.
//
// Why the weights are copied through a small ring (`stage`): a tile load from W's strided rows
// waits in order for all 16 of its lines, so memory latency stops the AMX pipe at every step
// (and 32 rows 2 or 4 KiB apart share two L1 sets, evicting what a prefetch brought). Ordinary
// vector loads a few steps ahead are out of order and keep memory streaming; the tile loads then
// read contiguous, L1-resident rows. That beats direct tile loads with prefetches at every row
// count (docs/benchmarks.md, "Kernel history").
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

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
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")

#include "gemv_amx_transpose.h"

namespace {
// Not _tile_loadconfig / _tile_storeconfig: GCC 12's amxtileintrin.h declares them to read or write
// 8 bytes of the 64 ("m" (*(const void **)config)), so the compiler may drop the stores of rows and
// colsb as dead. It did, where configure() was inlined into a short caller: every tile unconfigured,
// and the next tile instruction raised SIGILL. These name the whole struct.
inline void load_config(const TileConfig& cfg) { __asm__ volatile("ldtilecfg %0" : : "m"(cfg)); }
inline void store_config(TileConfig& cfg) { __asm__ volatile("sttilecfg %0" : "=m"(cfg)); }

// Tiles: A (W) 2, 3: 16 W rows x 32 k. m0, m1: the columns of the first and second block of B
// (x rows, or packed (part, row) pairs; see block()). One block: B 4 (packed) or 4, 5, 6 (the
// three parts), C 0, 1. Two blocks: B 4, 5 (packed, or one part of each block, loaded again for
// every part); C 0, 1 (block 0) and 6, 7 (block 1). C[i][j]: W row i, column j.
void configure(int64_t m0, int64_t m1) {
  TileConfig cfg;
  for (int t : {2, 3}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  const uint16_t c0 = uint16_t(4 * m0), c1 = uint16_t(4 * m1);
  for (int t : {0, 1, 4}) cfg.rows[t] = 16, cfg.colsb[t] = c0;
  if (m1 == 0) {
    for (int t : {5, 6}) cfg.rows[t] = 16, cfg.colsb[t] = c0;
  } else {
    for (int t : {5, 6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = c1;
  }
  load_config(cfg);
}

}  // namespace

// The tile configuration configure(m0, m1) leaves, read back: [rows of tiles 0..7, bytes per row of
// tiles 0..7] (tests; the tiles are released after).
std::vector<int> configured_tiles(int64_t m0, int64_t m1) {
  configure(m0, m1);
  TileConfig back;
  store_config(back);
  _tile_release();
  std::vector<int> out;
  for (int t = 0; t < 8; ++t) out.push_back(back.rows[t]);
  for (int t = 0; t < 8; ++t) out.push_back(back.colsb[t]);
  return out;
}

namespace {
constexpr int kAhead = 4;             // steps of 32 k the ring is filled ahead of the tile loads
constexpr int kRing = kAhead + 1;      // ring slots: [32 W rows][32 k] bf16, 2 KiB each
using Ring = uint16_t[kRing][32 * 32];

// ring slot <- W[32 rows from w0, k:k+32], contiguous (64 B rows)
// A ring slot <- W rows [32][k, k + 32); each row's line kFar steps later is prefetched into L2
// (past the row's end: the same line of the next block of 32 rows, which the next call streams).
// The hardware prefetchers follow 32 interleaved 2 KiB rows badly, and the L1 fill buffers alone
// (the staged loads) keep too few lines in flight to stream at memory speed.
constexpr int64_t kFar = 12;  // steps of 32 k

// 32 weights of one row as bf16: bf16 as they are; int8 sign-extended, converted to fp32 and
// rounded to bf16, all exact (integers up to 256 are bf16 numbers).
inline __m512i row32(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline __m512i row32(const int8_t* p) {
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // [lo 16 | hi 16]
}

template <typename T>
inline void stage(const T* w0, int64_t K, int64_t k, uint16_t* slot) {
  const int64_t far = k + kFar * 32 < K ? kFar * 32 : 32 * K + kFar * 32 - K;
  for (int r = 0; r < 32; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + r * K + k + far), _MM_HINT_T1);
    _mm512_store_si512(slot + r * 32, row32(w0 + r * K + k));
  }
}

// C tiles += W[32 rows from w0, k 0:K32] . B columns^T. PACKED: the B columns are all 3 M of
// (part, x row), MB blocks of 16 from b (M <= 10: each product once, 2 or 4 per step). Else the
// columns are one chunk's x rows (MB blocks of 16 from b), one part at a time, the parts M words
// apart: 6 or 12 products per step.
template <int MB, bool PACKED, typename T>
inline void block(const T* w0, int64_t K, int64_t K32, const uint16_t* b, int64_t M, Ring& ring) {
  const int64_t ldb = 12 * M, steps = K32 / 32;  // B row stride: 3 M words
  for (int64_t s = 0; s < std::min<int64_t>(kAhead, steps); ++s) stage(w0, K, s * 32, ring[s % kRing]);
  for (int64_t s = 0; s < steps; ++s) {
    if (s + kAhead < steps) stage(w0, K, (s + kAhead) * 32, ring[(s + kAhead) % kRing]);
    _tile_loadd(2, ring[s % kRing], 64);            // W rows 0..15
    _tile_loadd(3, ring[s % kRing] + 16 * 32, 64);  // W rows 16..31
    const uint16_t* bk = b + s * 16 * 3 * M * 2;    // 16 pairs of k a step
    if constexpr (PACKED) {
      _tile_loadd(4, bk, ldb);  // columns 0..15
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
      if constexpr (MB == 2) {
        _tile_loadd(5, bk + 32, ldb);  // columns 16.. (16 words further)
        _tile_dpbf16ps(6, 2, 5);
        _tile_dpbf16ps(7, 3, 5);
      }
    } else if constexpr (MB == 1) {
      _tile_loadd(4, bk, ldb);
      _tile_loadd(5, bk + 2 * M, ldb);
      _tile_loadd(6, bk + 4 * M, ldb);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
      _tile_dpbf16ps(0, 2, 5);
      _tile_dpbf16ps(1, 3, 5);
      _tile_dpbf16ps(0, 2, 6);
      _tile_dpbf16ps(1, 3, 6);
    } else {
      for (int q = 0; q < 3; ++q) {
        _tile_loadd(4, bk + q * 2 * M, ldb);       // x rows 0..15 of the chunk
        _tile_loadd(5, bk + q * 2 * M + 32, ldb);  // x rows 16.. (16 words further)
        _tile_dpbf16ps(0, 2, 4);
        _tile_dpbf16ps(1, 3, 4);
        _tile_dpbf16ps(6, 2, 5);
        _tile_dpbf16ps(7, 3, 5);
      }
    }
  }
}
}  // namespace

template <typename T>
inline void run_block(const T* w0, int64_t K, int64_t K32, const uint16_t* b, int64_t M, Ring& ring, bool packed,
                      bool two) {
  if (packed)
    two ? block<2, true>(w0, K, K32, b, M, ring) : block<1, true>(w0, K, K32, b, M, ring);
  else
    two ? block<2, false>(w0, K, K32, b, M, ring) : block<1, false>(w0, K, K32, b, M, ring);
}

// y[mc + m, nb + i] = (c[i][m] + the K % 32 tail) (* scale[nb + i] for int8) (+ bias[nb + i]) for the
// block's 32 W rows and the chunk's cm x rows: 16 x 16 transposes, whole vectors of y.
void store(const AmxArgs& a, const float* c, int64_t nb, int64_t mc, int64_t cm) {
  const int64_t K32 = a.K / 32 * 32;
  for (int ib = 0; ib < 32; ib += 16) {
    const __m512 bias = a.bias ? _mm512_loadu_ps(a.bias + nb + ib) : _mm512_setzero_ps();
    for (int64_t mb = 0; mb < cm; mb += 16) {
      const int64_t mn = std::min<int64_t>(16, cm - mb);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_maskz_loadu_ps(__mmask16((1u << mn) - 1), c + (ib + i) * 32 + mb);
      transpose16(r);  // r[m]: W rows ib..ib + 15 for x row mb + m
      for (int64_t m = 0; m < mn; ++m) {
        __m512 v = r[m];
        if (K32 < a.K) {  // the K tail, in scalar code: rare (K % 32 != 0)
          alignas(64) float t[16];
          const float* xr = a.x + (mc + mb + m) * a.K;
          for (int i = 0; i < 16; ++i) {
            const int64_t row = (nb + ib + i) * a.K;
            float s = 0.f;
            for (int64_t k = K32; k < a.K; ++k)
              s += (a.scale ? float(static_cast<const int8_t*>(a.w)[row + k])
                            : bf16_value(static_cast<const uint16_t*>(a.w)[row + k])) * xr[k];
            t[i] = s;
          }
          v = _mm512_add_ps(v, _mm512_load_ps(t));
        }
        if (a.scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(a.scale + nb + ib));  // int8: the row's scale
        _mm512_storeu_ps(a.y + (mc + mb + m) * a.N + nb + ib, _mm512_add_ps(v, bias));
      }
    }
  }
}

// y[:, n0:n1] for n1 - n0 a multiple of 32 (the caller gives the rest to the AVX-512 path). Each
// block of 32 W rows is read from memory once. Up to 10 rows, the 3 M (part, row) columns fill
// one or two B tiles and each part's sums are added in the epilogue; up to 32 rows, one pass with
// the parts in turn; beyond, chunks of 32 rows, the later ones finding the block in L2.
void rows(const AmxArgs& a, int64_t n0, int64_t n1) {
  const int64_t M = a.M, K = a.K, K32 = K / 32 * 32;
  alignas(64) float c[32 * 32];  // c[i][j]: W row i of the block, column j (x row, or part and row)
  alignas(64) Ring ring;
  const bool packed = 3 * M <= 32;
  int64_t configured = -1;  // the columns the tiles are configured for
  for (int64_t nb = n0; nb < n1; nb += 32) {
    for (int64_t mc = 0; mc < M; mc += kAmxChunk) {
      const int64_t cm = std::min(kAmxChunk, M - mc), cols = packed ? 3 * M : cm;
      const int64_t m0 = std::min<int64_t>(16, cols), m1 = cols - m0;
      if (cols != configured) configure(m0, m1), configured = cols;
      _tile_zero(0);
      _tile_zero(1);
      if (m1 > 0) {
        _tile_zero(6);
        _tile_zero(7);
      }
      const uint16_t* b = a.xb + mc * 2;  // the chunk's first x row
      if (a.scale)
        run_block(static_cast<const int8_t*>(a.w) + nb * K, K, K32, b, M, ring, packed, m1 > 0);
      else
        run_block(static_cast<const uint16_t*>(a.w) + nb * K, K, K32, b, M, ring, packed, m1 > 0);
      _tile_stored(0, c, 4 * 32);  // c[i][j]: W rows 0..15, columns 0..15
      _tile_stored(1, c + 16 * 32, 4 * 32);
      if (m1 > 0) {
        _tile_stored(6, c + 16, 4 * 32);  // columns 16..
        _tile_stored(7, c + 16 * 32 + 16, 4 * 32);
      }
      if (packed) {  // x row m = part sums in columns m, M + m, 2 M + m
        const __mmask16 keep = __mmask16((1u << M) - 1);
        for (int i = 0; i < 32; ++i) {
          const float* ci = c + i * 32;
          const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(keep, ci), _mm512_maskz_loadu_ps(keep, ci + M)),
                                           _mm512_maskz_loadu_ps(keep, ci + 2 * M));
          _mm512_mask_storeu_ps(c + i * 32, keep, sum);
        }
      }
      store(a, c, nb, mc, cm);
    }
  }
  _tile_release();
}

#pragma GCC pop_options

}  // namespace kvstate::amx
