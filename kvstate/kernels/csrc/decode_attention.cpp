// Full attention for a decode step (one query per sequence) over the paged KV pool, as one call
// per layer: per-head RMSNorm of q and k (optional), rotary on their first channels (optional,
// rotate-half form), the new k / v written at their KV rows, softmax attention over the
// sequence's blocks with grouped KV heads, and the output gate sigmoid(gate) (optional).
// torch's path runs ~40 small ops for this.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "decode_ops.h"
#include "simd_math.h"

namespace {

using torch::Tensor;

struct AttnArgs {
  const float *q, *k, *v, *gate;  // q / gate [n, H, D] and k / v [n, Hkv, D | Dv], strides below
  int64_t qs0, qs1, ks0, ks1, vs0, vs1, gs0, gs1;
  const float *q_norm, *k_norm, *inv_freq;  // [D], [D], [R / 2] or nullptr
  float eps, offset, scale;
  int64_t H, Hkv, D, Dv, R, BS, max_blocks;
  const int64_t *pos, *tables, *kv_idx;
  float *kc, *vc;  // [NB, BS, Hkv, D | Dv]
  float* o;        // [n, H, Dv]
};

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#include "decode_attention_math.h"

// x [D] -> y: RMSNorm (if w) then rotary on the first R channels at position p (if inv_freq)
void norm_rotate(const AttnArgs& a, const float* x, const float* w, int64_t p, float* y) {
  const int64_t D = a.D;
  if (w != nullptr) {
    const float r = 1.f / std::sqrt(dot(x, x, D) / static_cast<float>(D) + a.eps);
    for (int64_t c = 0; c < D; ++c) y[c] = (x[c] * r) * (w[c] + a.offset);
  } else {
    for (int64_t c = 0; c < D; ++c) y[c] = x[c];
  }
  if (a.inv_freq == nullptr) return;
  const int64_t half = a.R / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float f = static_cast<float>(p) * a.inv_freq[j];
    const float cs = std::cos(f), sn = std::sin(f), x0 = y[j], x1 = y[j + half];
    y[j] = x0 * cs + (-x1) * sn;
    y[j + half] = x1 * cs + x0 * sn;
  }
}

// Sequence i, KV head h: its G = H / Hkv query heads (qn [G, D], normalized, rotated) against the
// first L keys of the sequence's blocks -> o rows [G, Dv]. scores: G * L floats of scratch,
// stored [L, G] while the keys stream, then [G, L].
//
// Walked a KV block at a time (the math reads the block table once per block; only the prefetch
// below looks up the row kAhead keys on). Keys go
// two at a time through `dots2` (independent FMA chains); values a block at a time with the
// accumulators in registers (`values_block`), not a per-row loop of loads and stores of o, which was
// much slower (docs/benchmarks.md).
// The block table defeats the hardware prefetchers: each key also fetches the key kAhead rows
// on, and its own value row (read after the softmax) while a head's values fit in half an L2;
// past that the value pass fetches the next block's rows itself.
constexpr int64_t kEarlyValueBytes = 256 << 10;  // half of a Zen 3 / Sapphire Rapids core's L2, or less

void attend(const AttnArgs& a, int64_t i, int64_t h, const float* qn, int64_t L, float* scores, float* o) {
  const int64_t G = a.H / a.Hkv, D = a.D, Dv = a.Dv, BS = a.BS, stride = a.Hkv * D, vstride = a.Hkv * Dv;
  const int64_t* table = a.tables + i * a.max_blocks;
  std::vector<float> raw(G * L);
  constexpr int64_t kAhead = 4;
  const auto key = [&](int64_t t) { return a.kc + (table[t / BS] * BS + t % BS) * stride + h * D; };
  const auto fetch = [](const float* p, int64_t n) {
    for (int64_t c = 0; c < n; c += 16) _mm_prefetch(reinterpret_cast<const char*>(p + c), _MM_HINT_T0);
  };
  // values fetched in the key pass would be evicted before the value pass reads them again
  const bool values_early = L * Dv * int64_t(sizeof(float)) <= kEarlyValueBytes;
  for (int64_t t = 0; t < std::min(kAhead, L); ++t) fetch(key(t), D);
  for (int64_t t0 = 0; t0 < L; t0 += BS) {
    const int64_t nt = std::min(BS, L - t0), row0 = table[t0 / BS] * BS;
    const float* k = a.kc + row0 * stride + h * D;
    const float* v = a.vc + row0 * vstride + h * Dv;
    for (int64_t s = 0; s < nt; ++s) {
      if (t0 + s + kAhead < L) fetch(key(t0 + s + kAhead), D);
      if (values_early) fetch(v + s * vstride, Dv);
    }
    int64_t s = 0;
    float* r = raw.data() + t0 * G;
    if (G <= 4) {
      for (; s + 2 <= nt; s += 2) {
        const float *k0 = k + s * stride, *k1 = k0 + stride;
        float *r0 = r + s * G, *r1 = r0 + G;
        switch (G) {
          case 1: dots2<1>(qn, k0, k1, D, r0, r1); break;
          case 2: dots2<2>(qn, k0, k1, D, r0, r1); break;
          case 3: dots2<3>(qn, k0, k1, D, r0, r1); break;
          default: dots2<4>(qn, k0, k1, D, r0, r1);
        }
      }
    }
    for (; s < nt; ++s) dots_any(qn, G, k + s * stride, D, r + s * G);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < L; ++t) scores[g * L + t] = raw[t * G + g] * a.scale;
  for (int64_t g = 0; g < G; ++g) {  // softmax in place
    float* sg = scores + g * L;
    float m = -INFINITY;
    for (int64_t t = 0; t < L; ++t) m = std::max(m, sg[t]);
    float sum = 0.f;
    int64_t t = 0;
    const __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= L; t += 8) _mm256_storeu_ps(sg + t, kvstate::dec::exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv)));
    for (; t < L; ++t) sg[t] = std::exp(sg[t] - m);
    for (t = 0; t < L; ++t) sum += sg[t];
    const float inv = 1.f / sum;
    for (t = 0; t < L; ++t) sg[t] *= inv;
    std::fill(o + g * Dv, o + (g + 1) * Dv, 0.f);
  }
  for (int64_t t0 = 0; t0 < L; t0 += BS) {
    const int64_t nt = std::min(BS, L - t0), t1 = t0 + BS;
    if (!values_early && t1 < L) {
      const float* vn = a.vc + table[t1 / BS] * BS * vstride + h * Dv;
      for (int64_t s = 0; s < std::min(BS, L - t1); ++s) fetch(vn + s * vstride, Dv);
    }
    values_block_any(G, a.vc + table[t0 / BS] * BS * vstride + h * Dv, vstride, nt, scores + t0, L, o, Dv);
  }
}

// The new rows' keys (k norm, rotary) and values into the cache at their KV rows.
void write_kv(const AttnArgs& a, int64_t n) {
  // the new keys and values into the pool (keys normalized and rotated)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < a.Hkv; ++h) {
      norm_rotate(a, a.k + i * a.ks0 + h * a.ks1, a.k_norm, a.pos[i], a.kc + (a.kv_idx[i] * a.Hkv + h) * a.D);
      const float* vs = a.v + i * a.vs0 + h * a.vs1;
      std::copy(vs, vs + a.Dv, a.vc + (a.kv_idx[i] * a.Hkv + h) * a.Dv);
    }
  }
}

// write_kv, then the attention of rows first .. n - 1 (their outputs from a.o on)
void step(const AttnArgs& a, int64_t n, int64_t first) {
  const int64_t G = a.H / a.Hkv;
  write_kv(a, n);
  at::parallel_for(first * a.Hkv, n * a.Hkv, 1, [&](int64_t j0, int64_t j1) {
    std::vector<float> qn(G * a.D), scores;
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = j / a.Hkv, h = j % a.Hkv, L = a.pos[i] + 1;
      for (int64_t g = 0; g < G; ++g)
        norm_rotate(a, a.q + i * a.qs0 + (h * G + g) * a.qs1, a.q_norm, a.pos[i], qn.data() + g * a.D);
      scores.resize(G * L);
      float* o = a.o + ((i - first) * a.H + h * G) * a.Dv;
      attend(a, i, h, qn.data(), L, scores.data(), o);
      if (a.gate == nullptr) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* gt = a.gate + i * a.gs0 + (h * G + g) * a.gs1;
        for (int64_t c = 0; c < a.Dv; ++c) o[g * a.Dv + c] *= 1.f / (1.f + std::exp(-gt[c]));
      }
    }
  });
}

#pragma GCC pop_options

void check_heads(const Tensor& t, const char* name, int64_t n, int64_t heads, int64_t d) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 3 && t.size(0) == n &&
                  t.size(1) == heads && t.size(2) == d && (t.stride(2) == 1 || d <= 1),
              "kvstate attention_decode: ", name, " must be a CPU float32 [", n, ", ", heads, ", ", d,
              "] tensor with a contiguous last dimension");
}

const float* opt_vec(const c10::optional<Tensor>& t, const char* name, int64_t n) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == n, "kvstate attention_decode: ",
              name, " must be a contiguous float32 tensor of ", n, " elements");
  return t->data_ptr<float>();
}

Tensor attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& gate,
                        const c10::optional<Tensor>& q_norm, const c10::optional<Tensor>& k_norm, double eps,
                        double offset, const c10::optional<Tensor>& inv_freq, const Tensor& positions,
                        Tensor k_cache, Tensor v_cache, const Tensor& block_tables, const Tensor& kv_indices,
                        double scale, int64_t first) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "kvstate attention_decode: caches must be [NB, BS, Hkv, D]");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), NB = k_cache.size(0), BS = k_cache.size(1);
  const int64_t Hkv = k_cache.size(2), Dv = v_cache.size(3);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "kvstate attention_decode: query heads must be a multiple of KV heads");
  check_heads(q, "q", n, H, D);
  check_heads(k, "k", n, Hkv, D);
  check_heads(v, "v", n, Hkv, Dv);
  if (gate.has_value()) check_heads(*gate, "gate", n, H, Dv);
  for (const Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->size(0) == NB && c->size(1) == BS &&
                    c->size(2) == Hkv,
                "kvstate attention_decode: caches must be contiguous float32 [NB, BS, Hkv, D]");
  TORCH_CHECK(k_cache.size(3) == D, "kvstate attention_decode: k cache head dim ", k_cache.size(3), " != ", D);
  for (const Tensor* t : {&positions, &kv_indices})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n,
                "kvstate attention_decode: positions and kv_indices must be contiguous int64 [n]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() && block_tables.dim() == 2 &&
                  block_tables.size(0) == n,
              "kvstate attention_decode: block_tables must be contiguous int64 [n, max_blocks]");
  const int64_t R = inv_freq.has_value() ? 2 * inv_freq->numel() : 0;
  TORCH_CHECK(R <= D, "kvstate attention_decode: rotary dims exceed the head dim");
  const int64_t *pos = positions.data_ptr<int64_t>(), *tab = block_tables.data_ptr<int64_t>();
  const int64_t* idx = kv_indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // every row the kernel will touch lies in the pool
    const int64_t nb = pos[i] / BS + 1;
    TORCH_CHECK(pos[i] >= 0 && nb <= block_tables.size(1), "kvstate attention_decode: position ", pos[i],
                " past the block table");
    TORCH_CHECK(idx[i] >= 0 && idx[i] < NB * BS, "kvstate attention_decode: KV row ", idx[i], " outside the pool");
    for (int64_t b = 0; b < nb; ++b)
      TORCH_CHECK(tab[i * block_tables.size(1) + b] >= 0 && tab[i * block_tables.size(1) + b] < NB,
                  "kvstate attention_decode: block ", tab[i * block_tables.size(1) + b], " outside the pool");
  }
  TORCH_CHECK(first >= 0 && first <= n, "kvstate attention_decode: first row ", first, " outside the ", n, " rows");
  auto o = at::empty({n - first, H * Dv}, q.options());
  const Tensor& gt = gate.has_value() ? *gate : q;
  AttnArgs a{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
             gate.has_value() ? gate->data_ptr<float>() : nullptr, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
             v.stride(0), v.stride(1), gt.stride(0), gt.stride(1), opt_vec(q_norm, "q_norm", D),
             opt_vec(k_norm, "k_norm", D), opt_vec(inv_freq, "inv_freq", R / 2), static_cast<float>(eps),
             static_cast<float>(offset), static_cast<float>(scale), H, Hkv, D, Dv, R, BS, block_tables.size(1), pos,
             tab, idx, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), o.data_ptr<float>()};
  pybind11::gil_scoped_release no_gil;
  step(a, n, first);
  return o;
}

}  // namespace

namespace kvstate::op {
Tensor attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& gate,
                        const c10::optional<Tensor>& q_norm, const c10::optional<Tensor>& k_norm, double eps,
                        double offset, const c10::optional<Tensor>& inv_freq, const Tensor& positions,
                        Tensor k_cache, Tensor v_cache, const Tensor& block_tables, const Tensor& kv_indices,
                        double scale) {
  return ::attention_decode(q, k, v, gate, q_norm, k_norm, eps, offset, inv_freq, positions, k_cache, v_cache,
                            block_tables, kv_indices, scale, 0);
}
Tensor attention_decode_from(const Tensor& q, const Tensor& k, const Tensor& v, const c10::optional<Tensor>& gate,
                             const c10::optional<Tensor>& q_norm, const c10::optional<Tensor>& k_norm, double eps,
                             double offset, const c10::optional<Tensor>& inv_freq, const Tensor& positions,
                             Tensor k_cache, Tensor v_cache, const Tensor& block_tables, const Tensor& kv_indices,
                             double scale, int64_t first) {
  return ::attention_decode(q, k, v, gate, q_norm, k_norm, eps, offset, inv_freq, positions, k_cache, v_cache,
                            block_tables, kv_indices, scale, first);
}
}  // namespace kvstate::op

namespace kvstate {

void register_decode_attention(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("attention_decode", &kvstate::op::attention_decode,
        "one query per sequence: q/k norm, rotary, KV write, paged softmax attention, output gate -> [n, H * Dv]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("gate"), py::arg("q_norm"), py::arg("k_norm"),
        py::arg("eps"), py::arg("offset"), py::arg("inv_freq"), py::arg("positions"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("kv_indices"), py::arg("scale"));
}

}  // namespace kvstate
