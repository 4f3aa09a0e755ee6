// The per-layer work of a decode step (one token per sequence) around the GEMVs: RMSNorms, GDN's
// gates, the causal-conv1d window update and the gated delta rule's recurrent step, fp32 math on
// raw rows. decode_kernels.cpp holds the math (AVX2+FMA code; the per-head delta rule also in AVX-512,
// decode_gdn.cpp), decode_ops.cpp the Python binding
// (checks, threads); `register_decode_ops` adds them to the extension module of gemv.cpp, and
// `register_decode_attention` the full-attention step of decode_attention.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pybind11 {
class module_;
}  // namespace pybind11

namespace kvstate::dec {

// y[D] = x * rsqrt(mean(x^2) + eps) * (w + offset)  (offset 1: Qwen's zero-centred weights)
void rms_norm_row(const float* x, const float* w, float offset, float eps, int64_t D, float* y);
// sum[D] = x + delta (the residual add), y = rms_norm_row(sum)
void add_rms_norm_row(const float* x, const float* delta, const float* w, float offset, float eps, int64_t D,
                      float* sum, float* y);
// y[N] = silu(gate) * up (the gated MLP's activation)
void silu_mul_row(const float* gate, const float* up, int64_t N, float* y);
// y[D] = x * rsqrt(mean(x^2) + eps) * w * silu(z)  (Qwen's GDN output norm; y may alias x)
void gated_rms_norm_row(const float* x, const float* z, const float* w, float eps, int64_t D, float* y);
// per head: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
void gdn_gates_row(const float* a, const float* b, const float* A_log, const float* dt_bias, int64_t HV, float* g,
                   float* beta);
// One conv step of D channels: window state [D, S] (newest column last, S >= W - 1) shifted in
// place to end with x; y[d] = act(bias[d] + sum_k window[d, S - W + 1 + k] * w[d, k] + x[d] * w[d, W-1]).
void conv_row(const float* x, float* state, const float* w, const float* bias, int64_t D, int64_t W, int64_t S,
              bool silu, float* y);
// x[n] *= rsqrt(sum(x^2) + 1e-6) * scale (the l2norm of q and k, q's scale folded in)
void l2norm_scale(float* x, int64_t n, float scale);
// One token of the gated delta rule on one head's state S [K, V], q already l2-normed and scaled,
// k l2-normed: S' = decay S; u = beta (v - S'^T k); out <- S' + k u^T; o = out^T q. `out` may be
// S (in place) or another [K, V] (S is then left as it was). tmp: 2 * V floats of scratch; next:
// the state [K, V] to prefetch meanwhile, or nullptr.
// Runs decode_gdn.cpp's AVX-512 form or gdn_head_avx2 (decode_kernels.cpp): AVX-512 where the CPU has it, unless
// set_gdn_head_isa("avx2") chose the other (tests run both).
void gdn_head(const float* S, float* out, const float* q, const float* k, const float* v, float decay, float beta,
              int64_t K, int64_t V, float* o, float* tmp, const float* next);
void gdn_head_avx2(const float* S, float* out, const float* q, const float* k, const float* v, float decay,
                   float beta, int64_t K, int64_t V, float* o, float* tmp, const float* next);
std::string gdn_head_isa();
void set_gdn_head_isa(const std::string& isa);
// The best form within an ISA cap ("avx512" or "avx2") on this CPU.
std::string gdn_head_isa_within(const std::string& cap);
// Calls of `heads` (decode_ops.cpp) per form, for the test run's summary of the paths it exercised.
void count_gdn_head_call();
std::vector<std::pair<std::string, int64_t>> gdn_head_calls();

}  // namespace kvstate::dec

// The Tensor-level ops, for the one-call decode blocks (decode_block.cpp); each is the function the
// extension module binds under the same name (checks included), defined in gemv.cpp, decode_ops.cpp
// and decode_attention.cpp.
#include <torch/extension.h>
namespace kvstate::op {
using torch::Tensor;
Tensor linear(const Tensor& x, const Tensor& w, const c10::optional<Tensor>& scale, const std::string& isa);
// GGML blocks [N, bytes per row] of `type` (quant_gemv.cpp); isa "auto": the best vector ISA within the cap
Tensor quant_linear(const Tensor& x, const Tensor& w, const c10::optional<Tensor>& bias, int64_t type,
                    const std::string& isa);
// several GGML block weights of one input [N_i, bytes per row], types[i] each -> y [M, sum N_i]
Tensor quant_linear_parts(const Tensor& x, const std::vector<Tensor>& ws, const std::vector<int64_t>& types,
                          const std::string& isa);
std::string vector_isa();  // the best of avx512 / avx2 that "auto" may use (gemv.cpp)
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps, double offset);
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& w, double eps,
                                        double offset);
Tensor silu_mul(const Tensor& gate, const Tensor& up);
Tensor gdn_decode(const Tensor& qkv, const Tensor& z, const Tensor& a, const Tensor& b, Tensor conv_pool,
                  const Tensor& conv_w, Tensor state_pool, const Tensor& slots, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_w, double norm_eps, double scale, int64_t H);
std::tuple<Tensor, Tensor, Tensor> gdn_verify(const Tensor& qkv, const Tensor& z, const Tensor& a, const Tensor& b,
                                              Tensor conv_pool, const Tensor& conv_w, Tensor state_pool,
                                              const Tensor& slots, const Tensor& cu_seqlens, const Tensor& A_log,
                                              const Tensor& dt_bias, const Tensor& norm_w, double norm_eps,
                                              double scale, int64_t H);
Tensor attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& gate,
                        const c10::optional<Tensor>& q_norm, const c10::optional<Tensor>& k_norm, double eps,
                        double offset, const c10::optional<Tensor>& inv_freq, const Tensor& positions,
                        Tensor k_cache, Tensor v_cache, const Tensor& block_tables, const Tensor& kv_indices,
                        double scale);
// attention_decode that writes every row's K and V but attends only from row `first` on -> [n - first, H * Dv]
Tensor attention_decode_from(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& gate,
                             const c10::optional<Tensor>& q_norm, const c10::optional<Tensor>& k_norm, double eps,
                             double offset, const c10::optional<Tensor>& inv_freq, const Tensor& positions,
                             Tensor k_cache, Tensor v_cache, const Tensor& block_tables, const Tensor& kv_indices,
                             double scale, int64_t first);
}  // namespace kvstate::op

namespace kvstate {
void register_decode_ops(pybind11::module_& m);
void register_decode_blocks(pybind11::module_& m);  // decode_block.cpp
void register_decode_attention(pybind11::module_& m);  // decode_attention.cpp
}  // namespace kvstate
