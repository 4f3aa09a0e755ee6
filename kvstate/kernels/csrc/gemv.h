// Skinny GEMM y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for decode-sized M, fp32 math.
// One implementation per ISA (gemv_avx512.cpp, gemv_avx2.cpp), chosen at run time in gemv.cpp.
#pragma once

#include <cstdint>
#include <vector>

namespace kvstate {

// How the weights are stored: fp32, bf16 (widened exactly), or int8 with one fp32 scale per W row
// (weight-only quantization: y[m, n] = scale[n] * sum_k q[n, k] x[m, k], the sum in fp32).
enum WKind { kF32, kBf16, kI8 };

struct GemvArgs {
  const float* x;     // [M, Kp]: x zero-padded to Kp; for bf16 weights each block of 2*lanes is
                      // stored as [even lanes | odd lanes] (see prepare_x)
  int64_t M, K, Kp;
  const void* w;      // [N, K] row-major: float, bf16 bits (uint16) or int8
  WKind kind;
  const float* scale; // [N] per-row scales of int8 weights, else nullptr
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t N;
  bool narrow;        // the few-rows tile for every M (A/B, tests)
};

// Per ISA: prepare_x lays x out for the kernel (Kp = K rounded up to 2 * kLanes); rows computes
// the output columns [n0, n1) for every row of x and returns its register tile ("3x4": W rows x x rows),
// which each ISA picks by row class: kFewRows (1-2 rows, or `narrow`), kMidRows (5-8), kManyRows.
enum RowClass { kFewRows, kMidRows, kManyRows };
namespace avx512 {
constexpr int kLanes = 16;
void prepare_x(const float* x, int64_t M, int64_t K, int64_t Kp, bool bf16, float* xp);
const char* rows(const GemvArgs& a, int64_t n0, int64_t n1);
}  // namespace avx512
namespace avx2 {
constexpr int kLanes = 8;
void prepare_x(const float* x, int64_t M, int64_t K, int64_t Kp, bool bf16, float* xp);
const char* rows(const GemvArgs& a, int64_t n0, int64_t n1);
}  // namespace avx2

// AVX512_BF16 (bf16 weights, x in bf16 parts: see gemv_avx512bf16.cpp).
struct GemvBf16Args {
  const uint16_t* x;  // [M, Kp / 32, parts, 32] bf16 parts of x, zero-padded to Kp (a multiple of 32)
  int64_t M, K, Kp;
  int parts;          // 1 (x rounded to bf16), 2 or 3 (x split)
  const uint16_t* w;  // [N, K] bf16
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t N;
};
namespace avx512bf16 {
void prepare_x(const float* x, int64_t M, int64_t K, int64_t Kp, int parts, uint16_t* xb);
const char* rows(const GemvBf16Args& a, int64_t n0, int64_t n1);
// The GEMM of many x rows, parts 1 or 3 (gemm_avx512bf16.cpp): output columns [n0, n1), n0 a
// multiple of kGemmCols; used from kGemmRows x rows on (gemv.cpp: set_bf16_gemm_rows).
constexpr int64_t kGemmCols = 64;
constexpr int64_t kGemmRows = 64;
void gemm(const GemvBf16Args& a, int64_t n0, int64_t n1);
}  // namespace avx512bf16

// AMX (bf16 or int8 weights): 32 W rows per block, x rows in chunks of kAmxChunk; x as three bf16
// parts (see gemv_amx.cpp).
constexpr int64_t kAmxChunk = 32;
struct AmxArgs {
  const float* x;      // [M, K] as given (for the K % 32 tail)
  const uint16_t* xb;  // [K / 32 * 16][3][M][2] bf16 parts of x
  int64_t M, K;
  const void* w;       // [N, K] bf16, or int8 (widened to bf16 as it is staged: exact for |q| <= 127)
  const float* scale;  // [N] per-row scales of int8 weights, else nullptr
  const float* bias;
  float* y;
  int64_t N;
};
namespace amx {
bool usable();  // the CPU has AMX-BF16 and the OS granted the tile state
void prepare_x(const float* x, int64_t M, int64_t K, uint16_t* xb);
void rows(const AmxArgs& a, int64_t n0, int64_t n1);
std::vector<int> configured_tiles(int64_t m0, int64_t m1);
}  // namespace amx

}  // namespace kvstate
