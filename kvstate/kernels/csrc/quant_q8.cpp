// The "q8" mode of the GGML block weights (activation_dtype "q8", llama.cpp's arithmetic): the process
// flag quant_linear consults, the x layouts, the threaded call of the kernels (quant_q8_tile.h) and the
// bindings tests use to check each part against ggml's own code.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>

#include "quant_blocks.h"

namespace kvstate::quant {

namespace {
std::atomic<bool> q8_on{false};
std::atomic<int64_t> q8_calls[2];  // AVX-512 VNNI, AVX2

// looked up once: every q8 call asks
bool has_vnni() {
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }();
  return vnni;
}

void set_q8(bool on) {
  __builtin_cpu_init();
  TORCH_CHECK(!on || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
              "kvstate quant: the q8 mode needs AVX2");
  q8_on = on;
}

// ISA name ("avx512" runs the VNNI kernels where the CPU has them, "avx2" the AVX2 ones) -> wide
bool q8_wide(const std::string& isa) {
  TORCH_CHECK(isa == "avx512" || isa == "avx2", "kvstate quant: ISA avx512 or avx2, got ", isa);
  return isa == "avx512" && has_vnni();
}

// x [M, K] float32 quantized as `type`'s x blocks: uint8 [M, x_row_bytes] (for the tests)
at::Tensor quantize_x_op(const at::Tensor& x, int64_t type, const std::string& isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "kvstate quant: x must be contiguous float32 [M, K]");
  TORCH_CHECK(x_type(int(type)) != 0, "kvstate quant: the q8 mode does not serve GGML type ", type);
  const int64_t M = x.size(0), K = x.size(1), bw = block_weights(int(type));
  TORCH_CHECK(K % bw == 0, "kvstate quant: K ", K, " is not whole blocks of ", bw);
  auto y = at::empty({M, x_row_bytes(int(type), K)}, x.options().dtype(at::kByte));
  const Args a{x.data_ptr<float>(), M, K, nullptr, 0, int(type), nullptr, nullptr, 0};
  if (q8_wide(isa))
    avx512::quantize_x(a, y.data_ptr<uint8_t>(), 0, M);
  else
    avx2::quantize_x(a, y.data_ptr<uint8_t>(), 0, M);
  return y;
}
}  // namespace

int x_type(int type) {
  switch (type) {
    case kQ8_0: case kQ4_0: return kXQ8_0;
    case kQ4_K: case kQ5_K: case kQ6_K: return kXQ8_K;
    default: return 0;
  }
}

int64_t x_row_bytes(int type, int64_t K) {
  return x_type(type) == kXQ8_0 ? K / 32 * int64_t(sizeof(BlockQ8_0)) : K / 256 * int64_t(sizeof(BlockQ8K));
}

bool q8_serves(int type, int64_t M) {
  return q8_on.load(std::memory_order_relaxed) && M <= kQ8MaxRows && x_type(type) != 0;
}

bool q8_vnni(bool wide) { return wide && has_vnni(); }

void count_q8(bool vnni) { q8_calls[vnni ? 0 : 1].fetch_add(1, std::memory_order_relaxed); }

XQ8 quantize_x_for(const Args& a, const int64_t* types, int64_t parts, bool vnni) {
  XQ8 xq;
  for (int64_t p = 0; p < parts; ++p) {
    auto& buf = x_type(int(types[p])) == kXQ8_0 ? xq.q8_0 : xq.q8_k;
    if (buf) continue;
    Args b = a;
    b.type = int(types[p]);
    const int64_t xrow = x_row_bytes(b.type, b.K);
    buf.reset(new uint8_t[std::max<int64_t>(1, b.M * xrow)]);
    uint8_t* out = buf.get();
    at::parallel_for(0, b.M, std::max<int64_t>(1, (16 << 10) / std::max<int64_t>(1, b.K)), [&](int64_t m0, int64_t m1) {
      if (vnni)
        avx512::quantize_x(b, out, m0, m1);
      else
        avx2::quantize_x(b, out, m0, m1);
    });
  }
  return xq;
}

void rows_q8_on(const Args& a, const void* xq, int64_t n0, int64_t n1, bool vnni) {
  if (vnni)
    avx512::rows_q8(a, xq, n0, n1);
  else
    avx2::rows_q8(a, xq, n0, n1);
}

}  // namespace kvstate::quant

namespace kvstate {
void register_quant_q8_ops(pybind11::module_& m) {
  using namespace kvstate::quant;
  m.def("set_q8_activations", &set_q8, "GGML block weights at up to 64 x rows: x quantized to 8 bits per block and "
        "integer dot products (llama.cpp's arithmetic), or the exact fp32 math (false, the default)",
        pybind11::arg("on"));
  m.def("q8_activations", [] { return q8_on.load(); }, "what set_q8_activations set");
  m.def("quant_q8_calls", [] { return std::vector<int64_t>{q8_calls[0].load(), q8_calls[1].load()}; },
        "quant_linear calls the q8 kernels ran since load: [avx512 vnni, avx2]");
  m.def("quant_q8_has_vnni", &has_vnni, "the CPU has AVX-512 VNNI: isa avx512 runs the q8 kernels with it");
  m.def("quant_quantize_x", &quantize_x_op,
        "x [M, K] as the q8 mode quantizes it for weights of GGML type `type`: ggml's block_q8_0 (Q8_0, Q4_0) or "
        "block_q8_K (the K-quants) rows, uint8 [M, bytes]", pybind11::arg("x"), pybind11::arg("type"),
        pybind11::arg("isa") = "avx2");
}
}  // namespace kvstate
