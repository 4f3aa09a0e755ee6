// The pieces the compiled decode blocks share (decode_block.cpp: the GDN block and the bindings;
// decode_mtp.cpp: the MTP head, which runs an attention block): weights, their GEMV, norms, the MLP
// half and the attention block.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "decode_ops.h"
#include "quant_blocks.h"

namespace kvstate::blocks {

using torch::Tensor;
using OptT = c10::optional<Tensor>;

// at::set_num_threads(n) for the scope when n > 0 and it differs; the count before, after it.
struct Threads {
  int prev;
  bool set;
  explicit Threads(int64_t n) : prev(at::get_num_threads()), set(n > 0 && n != prev) {
    if (set) at::set_num_threads(int(n));
  }
  ~Threads() {
    if (set) at::set_num_threads(prev);
  }
};

// A weight matrix [N, K] (fp32, bf16, int8 with its per-row scale [N], or GGML blocks of `type`), or
// the rows of several GGML block matrices of different types stacked (`parts`, `types`: a fused group
// of a Q4_K_M file, whose q/k/v mix Q4_K and Q6_K; `w` is then the first part).
struct Weight {
  Tensor w;
  OptT scale;
  int64_t type = 0;  // GGML_TYPE_* of uint8 blocks [N, bytes per row], else 0
  std::vector<Tensor> parts;
  std::vector<int64_t> types;
  OptT perm;  // int64 [K]: the weight's columns are x[:, perm] (`Linear.input_perm`)
  int64_t k() const {  // weights per row
    namespace q = kvstate::quant;
    return type ? w.size(1) / q::block_bytes(int(type)) * q::block_weights(int(type)) : w.size(1);
  }
};

// the best ISA the CPU has: Python runs compiled blocks only when no backend is forced
Tensor gemv(const Tensor& x_in, const Weight& w, int64_t wide);

struct Norm {
  Tensor w;
  double eps, offset;
};

// (x + delta, norm(x + delta)); without delta (the first block) (x, norm(x))
std::tuple<Tensor, Tensor> add_norm(const Tensor& x, const OptT& delta, const Norm& n);

// The block's second half: ffn norm (with the mixer's residual add) and the gated (SiLU) MLP,
// gate and up fused in w_gu [2I, hidden]; its residual add is left pending for the next block.
struct Mlp {
  Norm norm;
  Weight w_gu, w_down;
  std::tuple<Tensor, Tensor> run(const Tensor& x, const Tensor& mixed, int64_t wide) const {
    auto [sum, h] = kvstate::op::add_rms_norm(x, mixed, norm.w, norm.eps, norm.offset);
    const Tensor gu = gemv(h, w_gu, wide);
    const int64_t I = w_down.k();
    const Tensor act = kvstate::op::silu_mul(gu.narrow(1, 0, I), gu.narrow(1, I, I));
    return {sum, gemv(act, w_down, wide)};
  }
};
struct AttnBlock {
  Norm norm;
  Weight w_qkv;  // [q (and gate) | k | v] rows of the fused projection
  int64_t H, Hkv, D, Dv;
  bool gated;  // q_proj is [H, 2D]: per head the query, then the output gate
  OptT q_norm, k_norm;
  double qk_eps, qk_offset;
  OptT inv_freq;
  double scale;
  Weight w_o;
  Mlp mlp;

  std::tuple<Tensor, Tensor> run(const Tensor& x, const OptT& delta, Tensor k_cache, Tensor v_cache,
                                 const Tensor& positions, const Tensor& tables, const Tensor& kv_indices, int64_t wide,
                                 bool kv_wide) const {
    return run_from(x, delta, k_cache, v_cache, positions, tables, kv_indices, wide, kv_wide, 0);
  }

  // `run` that writes every row's K and V but computes the rest only for rows first .. n - 1 (whose
  // outputs are those of `run`, row by row: no other row enters them)
  std::tuple<Tensor, Tensor> run_from(const Tensor& x, const OptT& delta, Tensor k_cache, Tensor v_cache,
                                      const Tensor& positions, const Tensor& tables, const Tensor& kv_indices,
                                      int64_t wide, bool kv_wide, int64_t first) const {
    auto [sum, h] = add_norm(x, delta, norm);
    const Tensor p = gemv(h, w_qkv, wide);
    const int64_t n = p.size(0), nq = H * D * (gated ? 2 : 1), nk = Hkv * D;
    Tensor q = p.narrow(1, 0, nq);
    OptT g;
    if (gated) {
      const Tensor qg = q.view({n, H, 2 * D});
      q = qg.narrow(2, 0, D);
      g = qg.narrow(2, D, D);
    } else {
      q = q.view({n, H, D});
    }
    const Tensor k = p.narrow(1, nq, nk).view({n, Hkv, D}), v = p.narrow(1, nq + nk, Hkv * Dv).view({n, Hkv, Dv});
    Tensor o;
    {
      Threads t(kv_wide ? wide : 0);
      o = kvstate::op::attention_decode_from(q, k, v, g, q_norm, k_norm, qk_eps, qk_offset, inv_freq, positions,
                                             k_cache, v_cache, tables, kv_indices, scale, first);
    }
    return mlp.run(first == 0 ? sum : sum.narrow(0, first, n - first), gemv(o, w_o, wide), wide);
  }
};

void register_mtp_head(pybind11::module_& m);  // decode_mtp.cpp

}  // namespace kvstate::blocks
