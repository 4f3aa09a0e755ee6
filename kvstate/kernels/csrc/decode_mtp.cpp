// The MTP head's compiled forward (`ext.MtpHead`, models/decode_blocks.py `head_for_step`).
#include "decode_block.h"

#include <algorithm>

namespace kvstate::blocks {

namespace {

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

void register_mtp_head(pybind11::module_& m) {
  namespace py = pybind11;
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

}  // namespace kvstate::blocks
