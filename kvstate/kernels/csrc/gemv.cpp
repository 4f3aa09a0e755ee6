// Python binding of the skinny GEMM: checks, run-time ISA choice, x preparation and the split of
// the output columns (W rows) over torch's intra-op threads.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <map>
#include <string>
#include <vector>

#include "decode_ops.h"
#include "gemv.h"
#include "quant_blocks.h"

namespace {

// The register tile of the last call's AVX path ("3x4"), for tests that prove a tile runs.
std::atomic<const char*> last_tile{"none"};
// The x-row chunks of the last AMX call (each a pass over every W block; only the first streams
// the block from memory), for tests that prove 17..32 rows take one pass.
std::atomic<int64_t> last_amx_passes{0};

bool has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool has_avx512bf16() {
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("avx512bf16");
}

// The ISAs this CPU can run, best first.
bool has_amx() {
  __builtin_cpu_init();
  return has_avx512() && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
         kvstate::amx::usable();
}

std::vector<std::string> isas() {
  std::vector<std::string> out;
  if (has_amx()) out.push_back("amx");
  if (has_avx512()) out.push_back("avx512");
  if (has_avx2()) out.push_back("avx2");
  return out;
}

// The best ISA "auto" may use (KVSTATE_KERNELS=avx2 or avx512, applied at load): 0 amx, 1 avx512, 2 avx2.
std::atomic<int> isa_cap{0};
const char* const kIsaNames[] = {"amx", "avx512", "avx2"};

int isa_rank(const std::string& isa) {
  for (int i = 0; i < 3; ++i)
    if (isa == kIsaNames[i]) return i;
  return -1;
}

// The best ISA this CPU has within the cap.
std::string auto_isa(const std::vector<std::string>& have) {
  for (const auto& isa : have)
    if (isa_rank(isa) >= isa_cap.load(std::memory_order_relaxed)) return isa;
  return have.back();
}

void set_isa_cap(const std::string& cap) {
  TORCH_CHECK(cap == "auto" || isa_rank(cap) >= 0, "kvstate kernels: ISA cap auto, amx, avx512 or avx2, got ", cap);
  isa_cap = cap == "auto" ? 0 : isa_rank(cap);
  kvstate::dec::set_gdn_head_isa(kvstate::dec::gdn_head_isa_within(isa_cap >= 2 ? "avx2" : "avx512"));
}

// bf16 parts of x for bf16 weights on the AVX-512 path (set_activation_parts): 0 keeps the fp32 math
// (weights widened exactly); 1 rounds x to bf16 (llama.cpp's bf16), 2-3 split it, for vdpbf16ps.
std::atomic<int> activation_parts{0};

void set_activation_parts(int parts) {
  TORCH_CHECK(parts >= 0 && parts <= 3, "kvstate kernels: activation parts 0 (fp32) to 3, got ", parts);
  TORCH_CHECK(parts == 0 || has_avx512bf16(), "kvstate kernels: this CPU has no AVX512_BF16");
  activation_parts = parts;
}

// From this many x rows the bf16 mode runs the GEMM (below, the skinny kernel: the GEMM's packing of W
// costs more than it saves); tests and benchmarks move it to force either path.
std::atomic<int64_t> gemm_rows{kvstate::avx512bf16::kGemmRows};

// y = x @ W^T (+ bias) by vdpbf16ps, x in `parts` bf16 parts, the W rows split over the threads: the
// skinny kernel for few rows, the GEMM (x rounded to bf16 only) from kGemmRows rows on.
void linear_bf16dp(const torch::Tensor& x, const torch::Tensor& w, const float* bias, torch::Tensor& y, int parts) {
  namespace bf = kvstate::avx512bf16;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), Kp = (K + 31) / 32 * 32;
  auto xb = at::empty({M * Kp * parts}, x.options().dtype(at::kBFloat16));
  auto* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, K)), [&](int64_t m0, int64_t m1) {
    bf::prepare_x(xp + m0 * K, m1 - m0, K, Kp, parts, xbp + m0 * Kp * parts);
  });
  const kvstate::GemvBf16Args args{xbp, M, K, Kp, parts, reinterpret_cast<const uint16_t*>(w.data_ptr()), bias,
                                   y.data_ptr<float>(), N};
  if (parts != 2 && M >= gemm_rows.load(std::memory_order_relaxed)) {
    at::parallel_for(0, (N + bf::kGemmCols - 1) / bf::kGemmCols, 1, [&](int64_t i0, int64_t i1) {
      bf::gemm(args, i0 * bf::kGemmCols, std::min(N, i1 * bf::kGemmCols));
    });
    last_tile.store("bf16 gemm 6x64", std::memory_order_relaxed);
    return;
  }
  const int64_t rows_per_item = 12, items = (N + rows_per_item - 1) / rows_per_item;
  const int64_t grain = std::max<int64_t>(1, ((64 << 10) + rows_per_item * K * 2 - 1) / (rows_per_item * K * 2));
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    last_tile.store(bf::rows(args, i0 * rows_per_item, std::min(N, i1 * rows_per_item)), std::memory_order_relaxed);
  });
}

// Calls per path since load (linear: the ISA its rows ran in), for the test run's summary.
std::atomic<int64_t> linear_calls[4];  // amx, avx512, avx2, avx512 bf16 dot products

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, const std::string& isa,
                     bool narrow, c10::optional<torch::Tensor> scale) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "kvstate gemv: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "kvstate gemv: x must be float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 ||
                               w.scalar_type() == at::kChar),
              "kvstate gemv: weight must be float32, bfloat16 or int8 [N, K]");
  const bool i8 = w.scalar_type() == at::kChar;
  TORCH_CHECK(i8 == scale.has_value(), "kvstate gemv: int8 weights need their per-row scale (and only they take one)");
  TORCH_CHECK(w.is_contiguous(), "kvstate gemv: weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "kvstate gemv: x has ", K, " columns, weight ", w.size(1));
  const float* bptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "kvstate gemv: bias must be contiguous float32 [N]");
    bptr = bias->data_ptr<float>();
  }
  const float* sptr = nullptr;
  if (i8) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == N,
                "kvstate gemv: scale must be contiguous float32 [N]");
    sptr = scale->data_ptr<float>();
  }
  const std::vector<std::string> have = isas();
  TORCH_CHECK(!have.empty(), "kvstate gemv: this CPU has neither AVX-512 nor AVX2+FMA");
  const std::string use = isa == "auto" ? auto_isa(have) : isa;
  TORCH_CHECK(std::find(have.begin(), have.end(), use) != have.end(), "kvstate gemv: ISA '", isa,
              "' not available on this CPU");
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  const kvstate::WKind kind = bf16 ? kvstate::kBf16 : i8 ? kvstate::kI8 : kvstate::kF32;
  // AMX serves bf16 and int8 weights for 3 or more rows, in blocks of 32 W rows; AVX-512 does the
  // rest (for 1-2 rows it computes less, and either way the weights stream at memory speed).
  const bool use_amx = use == "amx" && (bf16 || i8) && M >= 3;
  const bool wide = use != "avx2";
  const int parts = activation_parts.load(std::memory_order_relaxed);
  // the GEMM's rows of bf16 weights run vdpbf16ps in every mode, x in 3 parts for the exact one
  const bool gemm = bf16 && use == "avx512" && !narrow && has_avx512bf16() &&
                    M >= gemm_rows.load(std::memory_order_relaxed);
  const bool use_dp = bf16 && (parts > 0 || gemm) && use == "avx512" && !narrow;
  linear_calls[use_dp ? 3 : use_amx ? 0 : wide ? 1 : 2].fetch_add(1, std::memory_order_relaxed);
  const int lanes = wide ? kvstate::avx512::kLanes : kvstate::avx2::kLanes;

  x = x.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  pybind11::gil_scoped_release no_gil;
  if (use_dp) {
    linear_bf16dp(x, w, bptr, y, parts > 0 ? parts : 3);
    return y;
  }
  int64_t n_amx = 0;
  if (use_amx) {
    n_amx = N / 32 * 32;
    auto xb = at::empty({3 * (K / 32 * 32) * M}, x.options().dtype(at::kBFloat16));
    auto* xbp = reinterpret_cast<uint16_t*>(xb.data_ptr());
    kvstate::amx::prepare_x(x.data_ptr<float>(), M, K, xbp);
    const kvstate::AmxArgs args{x.data_ptr<float>(), xbp, M, K, w.data_ptr(), sptr, bptr, y.data_ptr<float>(), N};
    const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, 32 * K * 2));
    at::parallel_for(0, n_amx / 32, grain, [&](int64_t i0, int64_t i1) { kvstate::amx::rows(args, i0 * 32, i1 * 32); });
    if (n_amx > 0) last_amx_passes.store((M + kvstate::kAmxChunk - 1) / kvstate::kAmxChunk, std::memory_order_relaxed);
  }
  if (n_amx == N) return y;
  const int64_t Kp = (K + 2 * lanes - 1) / (2 * lanes) * (2 * lanes);
  auto xp = at::empty({M, Kp}, x.options());
  if (wide)
    kvstate::avx512::prepare_x(x.data_ptr<float>(), M, K, Kp, bf16, xp.data_ptr<float>());
  else
    kvstate::avx2::prepare_x(x.data_ptr<float>(), M, K, Kp, bf16, xp.data_ptr<float>());
  // narrow: every row through the few-rows tile (A/B and tests); it stays exact, only slower
  const kvstate::GemvArgs args{xp.data_ptr<float>(), M, K, Kp, w.data_ptr(), kind, sptr, bptr, y.data_ptr<float>(), N,
                               narrow};
  // Work items are 12 W rows (from n_amx on; whole blocks of 3 or 4 rows); a thread gets at least
  // ~64 KiB of weights so that tiny matrices do not pay for waking threads.
  const int64_t rows_per_item = 12;
  const int64_t items = (N - n_amx + rows_per_item - 1) / rows_per_item;
  const int64_t item_bytes = std::max<int64_t>(1, rows_per_item * K * w.element_size());
  const int64_t grain = std::max<int64_t>(1, ((64 << 10) + item_bytes - 1) / item_bytes);  // rounded up
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    const int64_t n0 = n_amx + i0 * rows_per_item, n1 = std::min(N, n_amx + i1 * rows_per_item);
    last_tile.store(wide ? kvstate::avx512::rows(args, n0, n1) : kvstate::avx2::rows(args, n0, n1),
                    std::memory_order_relaxed);
  });
  return y;
}

}  // namespace

namespace kvstate::op {
Tensor linear(const Tensor& x, const Tensor& w, const c10::optional<Tensor>& scale, const std::string& isa) {
  return ::linear(x, w, c10::nullopt, isa, false, scale);
}
std::string vector_isa() {
  std::vector<std::string> have;
  if (has_avx512()) have.push_back("avx512");
  if (has_avx2()) have.push_back("avx2");
  TORCH_CHECK(!have.empty(), "kvstate kernels: this CPU has neither AVX-512 nor AVX2+FMA");
  return auto_isa(have);
}
}  // namespace kvstate::op

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvstate skinny GEMM: y = x @ W^T (+ bias), W fp32, bf16 or int8 with per-row scales, fp32 math";
  m.def("linear", &linear, "y[M, N] = x[M, K] @ W[N, K]^T (* scale[N] for int8 W) (+ bias)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("isa") = "auto",
        pybind11::arg("narrow") = false, pybind11::arg("scale") = pybind11::none());
  m.def("last_tile", [] { return std::string(last_tile.load()); },
        "the register tile (W rows x x rows) the last AVX call ran, e.g. '3x4'");
  m.def("last_amx_passes", [] { return last_amx_passes.load(); },
        "x-row chunks (passes over each W block) of the last AMX call: 1 up to 32 rows");
  m.def("amx_configured_tiles", [](int64_t m0, int64_t m1) {
    TORCH_CHECK(has_amx(), "kvstate gemv: this CPU has no usable AMX");
    return kvstate::amx::configured_tiles(m0, m1);
  }, "the AMX tile configuration of m0 + m1 B columns, read back: rows of tiles 0..7, then their bytes per row",
        pybind11::arg("m0"), pybind11::arg("m1"));
  m.def("isas", &isas, "ISAs this CPU can run, best first");
  m.def("set_isa_cap", &set_isa_cap, "the best ISA every kernel may use: auto (no cap), amx, avx512 or avx2",
        pybind11::arg("cap"));
  m.def("has_avx512_bf16", &has_avx512bf16, "the CPU has AVX-512 BF16 (vdpbf16ps)");
  m.def("set_activation_parts", &set_activation_parts,
        "bf16 weights on AVX-512: 0 fp32 math (default), 1 x rounded to bf16, 2-3 x split into bf16 parts",
        pybind11::arg("parts"));
  m.def("activation_parts", [] { return activation_parts.load(); }, "what set_activation_parts set");
  m.def("set_bf16_gemm_rows", [](int64_t rows) {
    TORCH_CHECK(rows >= 1, "kvstate kernels: GEMM rows must be >= 1, got ", rows);
    const int64_t before = gemm_rows.exchange(rows);
    return before;
  }, "x rows from which the bf16 activations run the GEMM (default kGemmRows); returns the old value",
        pybind11::arg("rows"));
  m.def("isa_cap", [] { return std::string(isa_cap == 0 ? "auto" : kIsaNames[isa_cap.load()]); },
        "the cap set_isa_cap applied");
  m.def("paths_run", [] {
    std::map<std::string, int64_t> out;
    for (int i = 0; i < 3; ++i) out[std::string("linear ") + kIsaNames[i]] = linear_calls[i].load();
    out["linear avx512_bf16"] = linear_calls[3].load();
    for (const auto& [isa, n] : kvstate::dec::gdn_head_calls()) out["gdn head " + isa] = n;
    return out;
  }, "calls per kernel path since load: 'linear amx|avx512|avx2', 'gdn head avx512|avx2'");
  kvstate::register_decode_ops(m);  // the decode step's small ops (decode_ops.cpp)
  kvstate::register_quant_ops(m);   // GGML quantized blocks (quant_gemv.cpp)
}
