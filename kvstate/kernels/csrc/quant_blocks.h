// GGML quantized blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; layouts of ggml-common.h) times fp32 x, exact:
// each block is dequantized to the fp32 weights ggml's own dequantizer gives (the same products in the
// same order: d * sc first, then times the code, minus dmin * m), then multiplied with fp32 FMAs.
// One instance per ISA (quant_avx512.cpp, quant_avx2.cpp) of quant_tile.h; quant_gemv.cpp binds them.
#pragma once

#include <cstdint>

namespace pybind11 {
class module_;
}  // namespace pybind11

namespace kvstate::quant {

// GGML_TYPE_* numbers (ggml.h) of the types served
enum QType { kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23 };

int block_weights(int type);  // 32 or 256; 0 for a type not served
int block_bytes(int type);

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

}  // namespace kvstate::quant

namespace kvstate {
void register_quant_ops(pybind11::module_& m);
}  // namespace kvstate
