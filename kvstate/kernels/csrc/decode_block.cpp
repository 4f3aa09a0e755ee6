// One hybrid block of a decode step in one call: residual add + RMSNorm, the mixer's fused input
// projection, the mixer (Gated DeltaNet or gated attention), its output projection, residual add +
// RMSNorm, the gated MLP. The same Tensor-level ops the per-op path calls from Python
// (decode_ops.h, kvstate::op), in the same order on the same rows, so the numbers are identical; what
// goes is the Python between them. After each weight-streaming GEMV the caches hold weights, and
// every Python op then runs cold (the cost: docs/benchmarks.md, "Kernel history"): here only the
// kernels run in between.
//
// Threads, as `kernels.threads` has them inside a decode step: torch runs single-threaded, and the
// GEMVs (and a mixer whose state or KV is big) get `wide` threads (0: leave the count as it is).
#include "decode_block.h"

#include <algorithm>

namespace kvstate::blocks {

// the best ISA the CPU has: Python runs compiled blocks only when no backend is forced
Tensor gemv(const Tensor& x_in, const Weight& w, int64_t wide) {
  Threads t(wide);
  const Tensor x = w.perm.has_value() ? x_in.index_select(1, *w.perm) : x_in;
  if (!w.parts.empty()) return kvstate::op::quant_linear_parts(x.to(at::kFloat), w.parts, w.types, "auto");
  if (w.type) return kvstate::op::quant_linear(x.to(at::kFloat), w.w, c10::nullopt, w.type, "auto");
  return kvstate::op::linear(x, w.w, w.scale, "auto");
}

// (x + delta, norm(x + delta)); without delta (the first block) (x, norm(x))
std::tuple<Tensor, Tensor> add_norm(const Tensor& x, const OptT& delta, const Norm& n) {
  if (!delta.has_value()) return {x, kvstate::op::rms_norm(x, n.w, n.eps, n.offset)};
  return kvstate::op::add_rms_norm(x, *delta, n.w, n.eps, n.offset);
}

namespace {

struct GdnBlock {
  Norm norm;
  Weight w_in;  // [qkv | z | b | a] rows of the fused in_proj
  int64_t n_qkv, n_z, n_b;
  Tensor conv_w, A_log, dt_bias, norm_w;
  double norm_eps, scale;
  int64_t num_k_heads;
  Weight w_out;
  Mlp mlp;

  // -> (x + delta, the block's output delta); the pools updated in place at `slots`
  std::tuple<Tensor, Tensor> run(const Tensor& x, const OptT& delta, Tensor conv_pool, Tensor state_pool,
                                 const Tensor& slots, int64_t wide, bool state_wide) const {
    return around(x, delta, wide, state_wide, [&](const Tensor& qkv, const Tensor& z, const Tensor& a,
                                                  const Tensor& b) {
      return kvstate::op::gdn_decode(qkv, z, a, b, conv_pool, conv_w, state_pool, slots, A_log, dt_bias, norm_w,
                                     norm_eps, scale, num_k_heads);
    });
  }

  // A verify step (entries of several tokens, packed by cu_seqlens): -> (x + delta, the block's output
  // delta, the state [T, HV, K, V] and conv window [T, D, S] after every token, for the rollback)
  std::tuple<Tensor, Tensor, Tensor, Tensor> verify(const Tensor& x, const OptT& delta, Tensor conv_pool,
                                                    Tensor state_pool, const Tensor& slots, const Tensor& cu_seqlens,
                                                    int64_t wide, bool state_wide) const {
    Tensor states, windows;
    auto [sum, out] = around(x, delta, wide, state_wide, [&](const Tensor& qkv, const Tensor& z, const Tensor& a,
                                                             const Tensor& b) {
      Tensor o;
      std::tie(o, states, windows) = kvstate::op::gdn_verify(qkv, z, a, b, conv_pool, conv_w, state_pool, slots,
                                                             cu_seqlens, A_log, dt_bias, norm_w, norm_eps, scale,
                                                             num_k_heads);
      return o;
    });
    return {sum, out, states, windows};
  }

 private:
  // The block around its mixer: norm, the fused in_proj split into qkv, z, a, b, then
  // `mixer(qkv, z, a, b) -> o` (on `wide` threads when the state it streams is big), out_proj and the MLP.
  template <typename Mixer>
  std::tuple<Tensor, Tensor> around(const Tensor& x, const OptT& delta, int64_t wide, bool state_wide,
                                    const Mixer& mixer) const {
    auto [sum, h] = add_norm(x, delta, norm);
    const Tensor p = gemv(h, w_in, wide);
    const int64_t n_a = p.size(1) - n_qkv - n_z - n_b;
    Tensor o;
    {
      Threads t(state_wide ? wide : 0);
      o = mixer(p.narrow(1, 0, n_qkv), p.narrow(1, n_qkv, n_z), p.narrow(1, n_qkv + n_z + n_b, n_a),
                p.narrow(1, n_qkv + n_z, n_b));
    }
    return mlp.run(sum, gemv(o, w_out, wide), wide);
  }
};

}  // namespace

}  // namespace kvstate::blocks

namespace kvstate {

void register_decode_blocks(pybind11::module_& m) {
  using namespace kvstate::blocks;
  namespace py = pybind11;
  py::class_<Weight>(m, "Weight",
                     "a weight matrix for the compiled blocks: fp32, bf16, int8 with per-row scales, or GGML blocks "
                     "(uint8 [N, bytes per row]) of GGML type `type`")
      .def(py::init([](Tensor w, OptT scale, int64_t type, OptT perm) {
             namespace q = kvstate::quant;
             TORCH_CHECK(type == 0 || (q::block_weights(int(type)) > 0 && w.scalar_type() == at::kByte &&
                                       w.dim() == 2 && w.size(1) % q::block_bytes(int(type)) == 0),
                         "kvstate Weight: GGML type ", type, " needs uint8 blocks [N, a multiple of its block bytes]");
             Weight out{w, scale, type};
             if (perm.has_value()) {
               TORCH_CHECK(perm->scalar_type() == at::kLong && perm->dim() == 1 && perm->numel() == out.k(),
                           "kvstate Weight: perm must be int64 [", out.k(), "]");
               out.perm = perm;
             }
             return out;
           }),
           py::arg("weight"), py::arg("scale") = py::none(), py::arg("type") = 0, py::arg("perm") = py::none())
      .def_static(
          "parts",
          [](std::vector<Tensor> parts, std::vector<int64_t> types) {
            namespace q = kvstate::quant;
            TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "kvstate Weight.parts: one type per part");
            int64_t k = -1;
            for (size_t i = 0; i < parts.size(); ++i) {
              const int64_t t = types[i];
              TORCH_CHECK(q::block_weights(int(t)) > 0 && parts[i].scalar_type() == at::kByte && parts[i].dim() == 2 &&
                              parts[i].is_contiguous() && parts[i].size(1) % q::block_bytes(int(t)) == 0,
                          "kvstate Weight.parts: part ", i, " (GGML type ", t, ") needs contiguous uint8 blocks");
              const int64_t ki = parts[i].size(1) / q::block_bytes(int(t)) * q::block_weights(int(t));
              TORCH_CHECK(k < 0 || ki == k, "kvstate Weight.parts: part ", i, " has rows of ", ki, " weights, not ", k);
              k = ki;
            }
            return Weight{parts[0], c10::nullopt, types[0], parts, types};
          },
          "the stacked rows of GGML block matrices of different types (one input, one output)", py::arg("parts"),
          py::arg("types"));
  py::class_<GdnBlock>(m, "GdnBlock", "a Gated DeltaNet + gated MLP block of a decode step, one call")
      .def(py::init([](Tensor norm_w, double norm_eps, double norm_offset, Weight w_in, int64_t n_qkv, int64_t n_z,
                       int64_t n_b, Tensor conv_w, Tensor A_log, Tensor dt_bias, Tensor gnorm_w, double gnorm_eps,
                       double scale, int64_t num_k_heads, Weight w_out, Tensor ffn_norm_w, double ffn_eps,
                       double ffn_offset, Weight w_gu, Weight w_down) {
             return GdnBlock{{norm_w, norm_eps, norm_offset}, w_in, n_qkv, n_z, n_b, conv_w, A_log, dt_bias, gnorm_w,
                             gnorm_eps, scale, num_k_heads, w_out, {{ffn_norm_w, ffn_eps, ffn_offset}, w_gu, w_down}};
           }))
      .def("run", &GdnBlock::run, py::arg("x"), py::arg("delta"), py::arg("conv_pool"), py::arg("state_pool"),
           py::arg("slots"), py::arg("wide"), py::arg("state_wide"))
      .def("verify", &GdnBlock::verify, py::arg("x"), py::arg("delta"), py::arg("conv_pool"), py::arg("state_pool"),
           py::arg("slots"), py::arg("cu_seqlens"), py::arg("wide"), py::arg("state_wide"));
  py::class_<AttnBlock>(m, "AttnBlock", "a (gated) attention + gated MLP block of a decode step, one call")
      .def(py::init([](Tensor norm_w, double norm_eps, double norm_offset, Weight w_qkv, int64_t H, int64_t Hkv,
                       int64_t D, int64_t Dv, bool gated, OptT q_norm, OptT k_norm, double qk_eps, double qk_offset,
                       OptT inv_freq, double scale, Weight w_o, Tensor ffn_norm_w, double ffn_eps, double ffn_offset,
                       Weight w_gu, Weight w_down) {
             return AttnBlock{{norm_w, norm_eps, norm_offset}, w_qkv, H, Hkv, D, Dv, gated, q_norm, k_norm, qk_eps,
                              qk_offset, inv_freq, scale, w_o, {{ffn_norm_w, ffn_eps, ffn_offset}, w_gu, w_down}};
           }))
      .def("run", &AttnBlock::run, py::arg("x"), py::arg("delta"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("positions"), py::arg("tables"), py::arg("kv_indices"), py::arg("wide"), py::arg("kv_wide"));
  blocks::register_mtp_head(m);
}

}  // namespace kvstate
