// GGML quantized blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; layouts of ggml-common.h) times fp32 x, exact:
// each block is dequantized to the fp32 weights ggml's own dequantizer gives (the same products in the
// same order: d * sc first, then times the code, minus dmin * m), then multiplied with fp32 FMAs.
// One instance per ISA (quant_avx512.cpp, quant_avx2.cpp) of quant_tile.h; quant_gemv.cpp binds them.
#pragma once

#include <cstdint>
#include <memory>

namespace pybind11 {
class module_;
}  // namespace pybind11

namespace kvstate::quant {

// GGML_TYPE_* numbers (ggml.h) of the types served
enum QType { kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23 };

// weights per block (32 or 256) and bytes per block of each type served; 0 for a type not served
constexpr int block_weights(int type) {
  switch (type) {
    case kQ4_0: case kQ8_0: case kIQ4_NL: return 32;
    case kQ4_K: case kQ5_K: case kQ6_K: case kIQ4_XS: return 256;
    default: return 0;
  }
}
constexpr int block_bytes(int type) {
  switch (type) {
    case kQ4_0: case kIQ4_NL: return 18;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kIQ4_XS: return 136;
    default: return 0;
  }
}

// The 6-bit scales and mins of the 8 sub-blocks of a Q4_K / Q5_K block `b` (get_scale_min_k4): its 12
// bytes rearranged 32 bits at a time, as ggml's x86 kernels do: u[0..1] the 8 scales, u[2..3] the 8
// mins, a byte each.
inline void k4_scales_mins(const uint8_t* b, uint32_t u[4]) {
  __builtin_memcpy(u, b + 4, 12);
  constexpr uint32_t k1 = 0x3f3f3f3f, k2 = 0x0f0f0f0f, k3 = 0x03030303;
  u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
  const uint32_t m03 = u[1] & k1;
  u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
  u[2] = m03;
  u[0] &= k1;
}

struct Args {
  const float* x;    // [M, K] contiguous
  int64_t M, K;
  const uint8_t* w;  // [N, row_bytes] blocks
  int64_t row_bytes;
  int type;
  const float* bias;  // [N] or nullptr
  float* y;           // [M, N]
  int64_t N;
};

// rows: y [M, N] for the W rows [n0, n1); dequantize_rows: those W rows as fp32 into y [N, K] (x unused)
namespace avx512 {
void rows(const Args& a, int64_t n0, int64_t n1);
void dequantize_rows(const Args& a, int64_t n0, int64_t n1);
}  // namespace avx512
namespace avx2 {
void rows(const Args& a, int64_t n0, int64_t n1);
void dequantize_rows(const Args& a, int64_t n0, int64_t n1);
}  // namespace avx2

// The opt-in llama.cpp arithmetic (activation_dtype "q8", quant_q8.cpp): x quantized per row as ggml's
// vec_dot_type of the weight type (block_q8_0 for Q8_0 / Q4_0 weights, block_q8_K for the K-quants), then
// integer dot products per block, each block's float scales applied in fp32.
// x_type(type): kQ8_0 or kQ8_K (0 where "q8" does not serve `type`); x_row_bytes: one quantized x row.
enum XType { kXQ8_0 = 8, kXQ8_K = 15 };
struct BlockQ8_0 {  // ggml's block_q8_0: d = amax / 127 (fp16), codes round(x / d)
  uint16_t d;
  int8_t qs[32];
};
struct BlockQ8K {  // ggml's block_q8_K: d (fp32, its sign that of -max), codes, the sum of each 16 codes
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ8K) == 292, "ggml's block layouts");
int x_type(int type);
int64_t x_row_bytes(int type, int64_t K);
// How far ahead of the block in hand a kernel prefetches its W stream (rows are contiguous: into the
// next ones). The hardware prefetchers alone left 8-row calls at the sum of their memory and compute
// time where rows are long (K = 3584, "q8" mode, Zen 5, GB/s of blocks: Q4_K 10 -> 15, Q6_K 12 -> 21,
// Q8_0 11 -> 14; AVX2 7.7 -> 8.8, 8.6 -> 12, 8.6 -> 12), and one row ran faster too (Q8_0 46 -> 60);
// 2 and 4 KiB ahead did less.
constexpr int kPrefetchAhead = 8 << 10;
// Whether quant_linear runs `type` with M x rows the "q8" way (the mode is on, M <= kQ8MaxRows, a type
// it serves).
constexpr int64_t kQ8MaxRows = 64;  // blocks.MAX_ROWS
bool q8_serves(int type, int64_t M);
// For quant_linear's weight parts of one input (quant_gemv.cpp): x quantized once for each x
// type among the parts' `types` (x: a's x, M, K), then each part's row ranges through rows_q8_on. `vnni`
// is q8_vnni(wide): whether the AVX-512 VNNI kernels run (else the AVX2 ones); count_q8 records a call.
struct XQ8 {
  std::unique_ptr<uint8_t[]> q8_0, q8_k;
  const void* of(int type) const { return x_type(type) == kXQ8_0 ? q8_0.get() : q8_k.get(); }
};
bool q8_vnni(bool wide);
void count_q8(bool vnni);
XQ8 quantize_x_for(const Args& a, const int64_t* types, int64_t parts, bool vnni);
void rows_q8_on(const Args& a, const void* xq, int64_t n0, int64_t n1, bool vnni);
// quantize_x: x rows [m0, m1) of a.x into xq (x_row_bytes each); rows_q8: y [M, N] for the W rows [n0, n1)
// from xq. A caller that splits the rows over threads itself quantizes x once, then calls rows_q8 per
// range; parts of one input whose types have the same x_type (Q4_K, Q5_K and Q6_K all take block_q8_K)
// share that one quantized x.
namespace avx512 {  // AVX-512 with VNNI (256-bit vpdpbusd / vpdpwssd)
void quantize_x(const Args& a, void* xq, int64_t m0, int64_t m1);
void rows_q8(const Args& a, const void* xq, int64_t n0, int64_t n1);
}  // namespace avx512
namespace avx2 {
void quantize_x(const Args& a, void* xq, int64_t m0, int64_t m1);
void rows_q8(const Args& a, const void* xq, int64_t n0, int64_t n1);
}  // namespace avx2

}  // namespace kvstate::quant

namespace kvstate {
void register_quant_ops(pybind11::module_& m);
void register_quant_q8_ops(pybind11::module_& m);  // quant_q8.cpp
}  // namespace kvstate
