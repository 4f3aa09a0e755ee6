// Python binding of the block GEMM (quant_blocks.h): checks, the ISA, and the split of the W rows over
// torch's intra-op threads; `register_quant_ops` adds it to the extension module of gemv.cpp.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "decode_ops.h"
#include "quant_blocks.h"

namespace kvstate::quant {

namespace {
std::atomic<int64_t> calls[2];  // avx512, avx2

// true for AVX-512, false for AVX2 ("auto": the best this CPU has within the cap); refuses one it lacks
bool wide_isa(const std::string& isa_in) {
  __builtin_cpu_init();
  const std::string isa = isa_in == "auto" ? kvstate::op::vector_isa() : isa_in;
  const bool wide = isa == "avx512";
  TORCH_CHECK(wide || isa == "avx2", "kvstate quant: ISA avx512 or avx2, got ", isa);
  TORCH_CHECK(wide ? __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                   : __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "kvstate quant: ISA '", isa, "' not available on this CPU");
  return wide;
}

// weights per row of blocks `w` of `type` (checked)
int64_t row_weights(const at::Tensor& w, int64_t type) {
  const int bw = block_weights(int(type));
  TORCH_CHECK(bw > 0, "kvstate quant: GGML type ", type, " is not served (Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "kvstate quant: weight must be contiguous uint8 blocks [N, bytes per row]");
  TORCH_CHECK(w.size(1) % block_bytes(int(type)) == 0, "kvstate quant: weight rows of ", w.size(1),
              " bytes are not whole blocks of type ", type);
  return w.size(1) / block_bytes(int(type)) * bw;
}
}  // namespace
}  // namespace kvstate::quant

namespace kvstate::op {

namespace {

// y [M, sum N_i] = x @ [W_0; W_1; ...]^T (+ bias, one part only), each W_i GGML blocks of types[i]: the body
// of quant_linear (one part) and quant_linear_parts (a Q4_K_M layer's q/k/v or GDN in_proj mixing Q4_K and
// Q6_K). One pass over the threads, split by bytes, not rows (a Q6_K row is 1.5x a Q4_K one; a thread gets
// at least ~64 KiB of blocks: tiny matrices do not pay for waking threads), each part's rows written at
// its columns of y; in the q8 mode (quant_q8.cpp), where it serves every part, x is quantized once.
Tensor linear_parts(const Tensor& x_in, const std::vector<Tensor>& ws, const std::vector<int64_t>& types,
                    const float* bias, const std::string& isa_in) {
  using namespace kvstate::quant;
  TORCH_CHECK(x_in.device().is_cpu(), "kvstate quant: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "kvstate quant: x must be float32 [M, K]");
  const Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = int64_t(ws.size());
  std::vector<int64_t> col(P + 1, 0), byte(P + 1, 0);  // each part's first column and first byte
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(row_weights(ws[p], types[p]) == K, "kvstate quant: x has ", K, " columns; ",
                P == 1 ? std::string("the weight") : "part " + std::to_string(p) + "'s", " rows hold ", ws[p].size(1),
                " bytes");
    col[p + 1] = col[p] + ws[p].size(0);
    byte[p + 1] = byte[p] + ws[p].numel();
  }
  const bool wide = wide_isa(isa_in);
  auto y = at::empty({M, col[P]}, x.options());
  if (M == 0 || col[P] == 0) return y;
  const bool q8 = std::all_of(types.begin(), types.end(), [&](int64_t t) { return q8_serves(int(t), M); });
  const bool vnni = q8_vnni(wide);
  if (q8)
    count_q8(vnni);
  else
    calls[wide ? 0 : 1].fetch_add(1, std::memory_order_relaxed);
  pybind11::gil_scoped_release no_gil;
  const Args whole{x.data_ptr<float>(), M, K, nullptr, 0, 0, nullptr, nullptr, 0};
  const XQ8 xq = q8 ? quantize_x_for(whole, types.data(), P, vnni) : XQ8{};
  at::parallel_for(0, byte[P], 64 << 10, [&](int64_t b0, int64_t b1) {
    for (int64_t p = 0; p < P; ++p) {  // the rows of part p whose first byte lies in [b0, b1)
      const int64_t rb = ws[p].size(1);
      const int64_t n0 = std::clamp((b0 - byte[p] + rb - 1) / rb, int64_t(0), ws[p].size(0));
      const int64_t n1 = std::clamp((b1 - byte[p] + rb - 1) / rb, int64_t(0), ws[p].size(0));
      if (n0 >= n1) continue;
      const Args args{x.data_ptr<float>(), M, K, ws[p].data_ptr<uint8_t>(), rb, int(types[p]), bias,
                      y.data_ptr<float>() + col[p], col[P]};
      if (q8)
        rows_q8_on(args, xq.of(args.type), n0, n1, vnni);
      else if (wide)
        avx512::rows(args, n0, n1);
      else
        avx2::rows(args, n0, n1);
    }
  });
  return y;
}

}  // namespace

Tensor quant_linear(const Tensor& x, const Tensor& w, const c10::optional<Tensor>& bias, int64_t type,
                    const std::string& isa) {
  const float* bptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "kvstate quant: bias must be contiguous float32 [N]");
    bptr = bias->data_ptr<float>();
  }
  return linear_parts(x, {w}, {type}, bptr, isa);
}

Tensor quant_linear_parts(const Tensor& x, const std::vector<Tensor>& ws, const std::vector<int64_t>& types,
                          const std::string& isa) {
  TORCH_CHECK(!ws.empty() && ws.size() == types.size(), "kvstate quant: one type per weight part");
  return linear_parts(x, ws, types, nullptr, isa);
}

Tensor quant_dequantize(const Tensor& w, int64_t type, const std::string& isa) {
  using namespace kvstate::quant;
  const int64_t K = row_weights(w, type), N = w.size(0);
  const bool wide = wide_isa(isa);
  auto y = at::empty({N, K}, w.options().dtype(at::kFloat));
  if (N == 0 || K == 0) return y;
  pybind11::gil_scoped_release no_gil;
  const Args args{nullptr, 0, K, w.data_ptr<uint8_t>(), w.size(1), int(type), nullptr, y.data_ptr<float>(), N};
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, w.size(1)));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (wide)
      avx512::dequantize_rows(args, n0, n1);
    else
      avx2::dequantize_rows(args, n0, n1);
  });
  return y;
}

}  // namespace kvstate::op

namespace kvstate {
void register_quant_ops(pybind11::module_& m) {
  m.def("quant_linear", &op::quant_linear,
        "y[M, N] = x[M, K] @ W^T (+ bias), W the GGML blocks [N, bytes per row] of type `type`, each dequantized "
        "exactly, fp32 math", pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("type"), pybind11::arg("isa") = "auto");
  m.def("quant_linear_parts", &op::quant_linear_parts,
        "y[M, sum N_i] = x[M, K] @ [W_0; W_1; ...]^T, each W_i GGML blocks [N_i, bytes per row] of type types[i], "
        "exact as quant_linear, in one pass over the threads", pybind11::arg("x"), pybind11::arg("weights"),
        pybind11::arg("types"), pybind11::arg("isa") = "auto");
  m.def("quant_dequantize", &op::quant_dequantize,
        "the fp32 weights [N, K] GGML blocks [N, bytes per row] of type `type` mean, exactly as ggml's dequantizer "
        "gives them", pybind11::arg("weight"), pybind11::arg("type"), pybind11::arg("isa") = "auto");
  register_quant_q8_ops(m);
  m.def("quant_calls", [] { return std::vector<int64_t>{quant::calls[0].load(), quant::calls[1].load()}; },
        "calls of quant_linear's exact kernels since load: [avx512, avx2]");
}
}  // namespace kvstate
