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
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "decode_ops.h"
#include "quant_blocks.h"

namespace {

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
Tensor gemv(const Tensor& x_in, const Weight& w, int64_t wide) {
  Threads t(wide);
  const Tensor x = w.perm.has_value() ? x_in.index_select(1, *w.perm) : x_in;
  if (!w.parts.empty()) return kvstate::op::quant_linear_parts(x.to(at::kFloat), w.parts, w.types, "auto");
  if (w.type) return kvstate::op::quant_linear(x.to(at::kFloat), w.w, c10::nullopt, w.type, "auto");
  return kvstate::op::linear(x, w.w, w.scale, "auto");
}

struct Norm {
  Tensor w;
  double eps, offset;
};

// (x + delta, norm(x + delta)); without delta (the first block) (x, norm(x))
std::tuple<Tensor, Tensor> add_norm(const Tensor& x, const OptT& delta, const Norm& n) {
  if (!delta.has_value()) return {x, kvstate::op::rms_norm(x, n.w, n.eps, n.offset)};
  return kvstate::op::add_rms_norm(x, *delta, n.w, n.eps, n.offset);
}

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

// The MTP head's forward over the rows of a decode-only step (docs/mtp.md), one call where the
// per-op path (models/mtp.py) runs ~15: the token's embedding row and the hidden state each through
// their pre-fc RMSNorm, fc over [e ; g], the head's attention block, mtp.norm, the shared LM head,
// and the argmax (the greedy draft). The same Tensor-level ops as that path, in the same order.
struct MtpHead {
  Tensor embed;  // [V, H] the target's embedding, fp32 or bf16
  Norm pre_e, pre_h;
  Weight fc;  // [H, 2H]: embedding half first, then the hidden half
  AttnBlock block;
  Norm norm;
  Weight lm_head;  // [V, H]

  // ids [T] int64 (the token after each row's position), hidden [T, H] fp32 (the target's normed
  // state, or the head's own y when chaining) -> (argmax [T] int64, y [T, H], logits [T, V] fp32)
  std::tuple<Tensor, Tensor, Tensor> run(const Tensor& ids, const Tensor& hidden, Tensor k_cache, Tensor v_cache,
                                         const Tensor& positions, const Tensor& tables, const Tensor& kv_indices,
                                         int64_t wide, bool kv_wide) const {
    return run_from(ids, hidden, k_cache, v_cache, positions, tables, kv_indices, wide, kv_wide, 0);
  }

  // `steps` chained drafts per entry i: the first from ids[i] and hidden[i] (the draft before it and
  // that draft's y) at position start[i], each next one at the next position from the one before and
  // its y; KV rows in the entry's blocks tables[i] [N, max_blocks] (block_size tokens each, grown to
  // cover the last position). -> drafts [N, steps] int64
  Tensor chain(const Tensor& ids, const Tensor& hidden, Tensor k_cache, Tensor v_cache, const Tensor& start,
               const Tensor& tables, int64_t block_size, int64_t steps, int64_t wide, bool kv_wide) const {
    TORCH_CHECK(start.scalar_type() == at::kLong && start.dim() == 1 && start.size(0) == ids.size(0),
                "kvstate MtpHead.chain: start must be int64 [N]");
    const int64_t n = start.size(0);
    auto drafts = at::empty({n, steps}, ids.options());
    const Tensor s = start.contiguous();
    chain_into(ids, hidden, k_cache, v_cache, s.data_ptr<int64_t>(), tables, block_size, steps, wide, kv_wide,
               drafts.data_ptr<int64_t>(), steps);
    return drafts;
  }

  // One entry after a decode or verify step: `run` over its rows, the tokens ids at positions start ..
  // start + n - 1 (the head's KV rows written there), then `steps` chained drafts from the last row at
  // the next positions; every row's KV in the blocks of `table` (the entry's block table, grown to
  // cover the last draft). Plain integers in and out: the positions, KV rows and tables are made here.
  // -> drafts [1 + steps]. serial: torch on one thread for the call but the GEMVs on `wide`
  // (kernels.threads' policy).
  std::vector<int64_t> run_chain(const std::vector<int64_t>& ids, const Tensor& hidden, Tensor k_cache,
                                 Tensor v_cache, int64_t start, const std::vector<int64_t>& table, int64_t block_size,
                                 int64_t steps, int64_t wide, bool kv_wide, bool serial) const {
    Threads one(serial ? 1 : 0);
    const int64_t n = int64_t(ids.size()), width = int64_t(table.size());
    TORCH_CHECK(n > 0 && block_size > 0 && steps >= 0, "kvstate MtpHead.run_chain: no rows, or a bad block size");
    const auto opts = at::TensorOptions().dtype(at::kLong);
    auto rows = at::empty({3, n}, opts);  // ids, positions, KV rows
    auto tables = at::empty({n, width}, opts);
    int64_t *id = rows.data_ptr<int64_t>(), *pos = id + n, *kv = pos + n, *tab = tables.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      id[i] = ids[i];
      pos[i] = start + i;
      const int64_t b = pos[i] / block_size;
      TORCH_CHECK(pos[i] >= 0 && b < width, "kvstate MtpHead.run_chain: position ", pos[i], " past the block table");
      kv[i] = table[b] * block_size + pos[i] % block_size;
      std::copy(table.begin(), table.end(), tab + i * width);
    }
    const int64_t last = n - 1, from = rows_apart() ? last : 0;  // only the last row's outputs are used
    auto out = run_from(rows[0], hidden, k_cache, v_cache, rows[1], tables, rows[2], wide, kv_wide, from);
    const Tensor first = std::get<0>(out).narrow(0, last - from, 1);  // [1]
    std::vector<int64_t> drafts(1 + steps);
    drafts[0] = first.data_ptr<int64_t>()[0];
    if (steps == 0) return drafts;
    const int64_t next = start + n;
    chain_into(first, std::get<1>(out).narrow(0, last - from, 1), k_cache, v_cache, &next, tables.narrow(0, 0, 1),
               block_size, steps, wide, kv_wide, drafts.data() + 1, 1 + steps);
    return drafts;
  }

 private:
  // `run`'s outputs for rows first .. T - 1 (every row's KV written): (argmax, y, logits) [T - first, ...]
  std::tuple<Tensor, Tensor, Tensor> run_from(const Tensor& ids, const Tensor& hidden, Tensor k_cache, Tensor v_cache,
                                              const Tensor& positions, const Tensor& tables, const Tensor& kv_indices,
                                              int64_t wide, bool kv_wide, int64_t first) const {
    const Tensor x = gemv(fc_input(ids, hidden), fc, wide);  // [T, 2H] -> [T, H]
    auto [sum, delta] =
        block.run_from(x, c10::nullopt, k_cache, v_cache, positions, tables, kv_indices, wide, kv_wide, first);
    const Tensor y = std::get<1>(kvstate::op::add_rms_norm(sum, delta, norm.w, norm.eps, norm.offset));
    const Tensor logits = gemv(y, lm_head, wide);  // [T - first, V]
    return {logits.argmax(1), y, logits};
  }

  // The GEMVs after the attention give each row what they give it alone: fp32 weights (AMX, which
  // serves bf16 and int8 weights from 3 rows on, computes another way than 1 row's path; every other
  // path gives a row the same bits whatever the rows beside it: tests/kernels/test_gemv.py).
  bool rows_apart() const {
    for (const Weight* w : {&block.w_o, &block.mlp.w_gu, &block.mlp.w_down, &lm_head})
      if (w->w.scalar_type() != at::kFloat) return false;
    return true;
  }

  // [e ; g] [T, 2H]: the embedding rows of ids and the hidden rows, each through its pre-fc norm. From an fp32
  // embedding the norms write their halves of one buffer (what rms_norm, rms_norm and cat compute, bit for bit).
  Tensor fc_input(const Tensor& ids, const Tensor& hidden) const {
    const int64_t T = ids.numel(), H = pre_h.w.numel(), V = embed.size(0);
    const bool direct = embed.scalar_type() == at::kFloat && embed.is_contiguous() && embed.size(1) == H &&
                        ids.scalar_type() == at::kLong && ids.dim() == 1 && hidden.scalar_type() == at::kFloat &&
                        hidden.dim() == 2 && hidden.size(0) == T && hidden.size(1) == H && hidden.stride(1) == 1 &&
                        pre_e.w.numel() == H && pre_e.w.is_contiguous() && pre_h.w.is_contiguous() &&
                        pre_e.w.scalar_type() == at::kFloat && pre_h.w.scalar_type() == at::kFloat;
    if (!direct) {
      const Tensor e = embed.index_select(0, ids).to(at::kFloat);  // [T, H]
      const Tensor en = kvstate::op::rms_norm(e, pre_e.w, pre_e.eps, pre_e.offset);
      const Tensor hn = kvstate::op::rms_norm(hidden, pre_h.w, pre_h.eps, pre_h.offset);
      return at::cat({en, hn}, 1);
    }
    auto out = at::empty({T, 2 * H}, hidden.options());
    const Tensor idc = ids.contiguous();
    const int64_t* id_of = idc.data_ptr<int64_t>();
    const float *E = embed.data_ptr<float>(), *h = hidden.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < T; ++i) {
      const int64_t id = id_of[i];
      TORCH_CHECK(id >= 0 && id < V, "kvstate MtpHead: token id ", id, " out of range for ", V, " embeddings");
      kvstate::dec::rms_norm_row(E + id * H, pre_e.w.data_ptr<float>(), pre_e.offset, pre_e.eps, H, o + i * 2 * H);
      kvstate::dec::rms_norm_row(h + i * hidden.stride(0), pre_h.w.data_ptr<float>(), pre_h.offset, pre_h.eps, H,
                                 o + i * 2 * H + H);
    }
    return out;
  }

  // `chain`'s loop, the positions and KV rows of each draft as plain integers (one [2, N] buffer for all
  // steps): draft s of entry i to out[i * stride + s].
  void chain_into(Tensor ids, Tensor hidden, Tensor k_cache, Tensor v_cache, const int64_t* start,
                  const Tensor& tables, int64_t block_size, int64_t steps, int64_t wide, bool kv_wide, int64_t* out,
                  int64_t stride) const {
    const int64_t n = ids.size(0);
    TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 2 && tables.size(0) == n && block_size > 0,
                "kvstate MtpHead.chain: tables must be int64 [N, max_blocks]");
    const Tensor tab = tables.contiguous();
    const int64_t width = tab.size(1);
    const int64_t* t = tab.data_ptr<int64_t>();
    auto rows = at::empty({2, n}, tab.options());  // positions [N], KV rows [N]
    int64_t *pos = rows.data_ptr<int64_t>(), *kv = pos + n;
    const Tensor positions = rows[0], kv_indices = rows[1];
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t i = 0; i < n; ++i) {
        pos[i] = start[i] + s;
        const int64_t b = pos[i] / block_size;
        TORCH_CHECK(pos[i] >= 0 && b < width, "kvstate MtpHead.chain: position ", pos[i], " past the block table");
        kv[i] = t[i * width + b] * block_size + pos[i] % block_size;
      }
      auto res = run(ids, hidden, k_cache, v_cache, positions, tab, kv_indices, wide, kv_wide);
      ids = std::get<0>(res);
      hidden = std::get<1>(res);
      const int64_t* d = ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i) out[i * stride + s] = d[i];
    }
  }
};

}  // namespace

namespace kvstate {

void register_decode_blocks(pybind11::module_& m) {
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
  py::class_<MtpHead>(m, "MtpHead", "an MTP head's forward over a decode step's rows, one call (docs/mtp.md)")
      .def(py::init([](Tensor embed, Tensor pre_e_w, Tensor pre_h_w, double eps, double offset, Weight fc,
                       const AttnBlock& block, Tensor norm_w, Weight lm_head) {
             return MtpHead{embed, {pre_e_w, eps, offset}, {pre_h_w, eps, offset}, fc, block, {norm_w, eps, offset},
                            lm_head};
           }))
      .def("run", &MtpHead::run, py::arg("ids"), py::arg("hidden"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("positions"), py::arg("tables"), py::arg("kv_indices"), py::arg("wide"), py::arg("kv_wide"))
      .def("chain", &MtpHead::chain, py::arg("ids"), py::arg("hidden"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("start"), py::arg("tables"), py::arg("block_size"), py::arg("steps"), py::arg("wide"),
           py::arg("kv_wide"))
      .def("run_chain", &MtpHead::run_chain, py::arg("ids"), py::arg("hidden"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("start"), py::arg("table"), py::arg("block_size"), py::arg("steps"),
           py::arg("wide"), py::arg("kv_wide"), py::arg("serial"));
}

}  // namespace kvstate
