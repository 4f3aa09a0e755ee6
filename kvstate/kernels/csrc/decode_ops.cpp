// Python binding of the decode-step ops (decode_ops.h): argument checks, slot lookups, scratch,
// and the split over torch's intra-op threads (the caller decides how many: inside a decode
// step torch runs single-threaded unless kvstate.kernels.decode widens a big call).
//
// Rows: 2-D float32 tensors whose last dimension is contiguous (any row stride, so the column
// views that `kernels.fused.project` returns go in without a copy). State pools: contiguous
// float32 [P, ...] updated in place at `slots` (int64 [n], distinct, in [0, P)).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

#include "decode_ops.h"

namespace {

using torch::Tensor;
constexpr int64_t kGrainBytes = 256 << 10;  // a thread's least share of state bytes

void check_rows(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2,
              "kvstate decode: ", name, " must be a CPU float32 [rows, cols] tensor");
  TORCH_CHECK(t.size(0) == rows && t.size(1) == cols, "kvstate decode: ", name, " must be [", rows, ", ", cols,
              "], got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1 || cols <= 1, "kvstate decode: ", name, " must have a contiguous last dimension");
}

void check_vec(const Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n,
              "kvstate decode: ", name, " must be a contiguous CPU float32 tensor of ", n, " elements");
}

void check_pool(const Tensor& pool, const char* name, const Tensor& slots, int64_t n) {
  TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == at::kFloat && pool.is_contiguous(),
              "kvstate decode: ", name, " must be a contiguous CPU float32 pool");
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.numel() == n && slots.is_contiguous(),
              "kvstate decode: slots must be a contiguous int64 [", n, "] tensor");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(s[i] >= 0 && s[i] < pool.size(0), "kvstate decode: slot ", s[i], " outside ", name, "'s ",
                pool.size(0), " slots");
}

int64_t grain(int64_t item_bytes) { return std::max<int64_t>(1, kGrainBytes / std::max<int64_t>(1, item_bytes)); }

// x [..., D] as [rows, D] rows with a contiguous last dimension (a view when it can be)
Tensor as_rows(const Tensor& x, int64_t D) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == D, "kvstate decode: x must be [..., ", D, "], got ", x.sizes());
  Tensor r = x.dim() == 2 ? x : x.reshape({-1, D});
  return r.stride(1) == 1 || D <= 1 ? r : r.contiguous();
}

Tensor rms_norm(const Tensor& x_, const Tensor& w, double eps, double offset) {
  const int64_t D = w.numel();
  const Tensor x = as_rows(x_, D);
  const int64_t M = x.size(0);
  check_rows(x, "x", M, D);
  check_vec(w, "weight", D);
  auto y = at::empty(x_.sizes(), x.options());  // contiguous: rows of D
  for (int64_t i = 0; i < M; ++i)
    kvstate::dec::rms_norm_row(x.data_ptr<float>() + i * x.stride(0), w.data_ptr<float>(), offset, eps, D,
                               y.data_ptr<float>() + i * D);
  return y;
}

std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& w, double eps,
                                        double offset) {
  const int64_t M = x.size(0), D = w.numel();
  check_rows(x, "x", M, D);
  check_rows(delta, "delta", M, D);
  check_vec(w, "weight", D);
  auto sum = at::empty({M, D}, x.options()), y = at::empty({M, D}, x.options());
  for (int64_t i = 0; i < M; ++i)
    kvstate::dec::add_rms_norm_row(x.data_ptr<float>() + i * x.stride(0), delta.data_ptr<float>() + i * delta.stride(0),
                                   w.data_ptr<float>(), offset, eps, D, sum.data_ptr<float>() + i * D,
                                   y.data_ptr<float>() + i * D);
  return {sum, y};
}

Tensor silu_mul(const Tensor& gate, const Tensor& up) {
  TORCH_CHECK(gate.dim() == 2, "kvstate decode: gate must be [M, N]");
  const int64_t M = gate.size(0), N = gate.size(1);
  check_rows(gate, "gate", M, N);
  check_rows(up, "up", M, N);
  auto y = at::empty({M, N}, gate.options());
  for (int64_t i = 0; i < M; ++i)
    kvstate::dec::silu_mul_row(gate.data_ptr<float>() + i * gate.stride(0), up.data_ptr<float>() + i * up.stride(0),
                               N, y.data_ptr<float>() + i * N);
  return y;
}

Tensor gated_rms_norm(const Tensor& x_, const Tensor& z_, const Tensor& w, double eps) {
  const int64_t D = w.numel();
  const Tensor x = as_rows(x_, D), z = as_rows(z_, D);
  const int64_t M = x.size(0);
  check_rows(x, "x", M, D);
  check_rows(z, "gate", M, D);
  check_vec(w, "weight", D);
  auto y = at::empty(x_.sizes(), x.options());
  for (int64_t i = 0; i < M; ++i)
    kvstate::dec::gated_rms_norm_row(x.data_ptr<float>() + i * x.stride(0), z.data_ptr<float>() + i * z.stride(0),
                                     w.data_ptr<float>(), eps, D, y.data_ptr<float>() + i * D);
  return y;
}

std::tuple<Tensor, Tensor> gdn_gates(const Tensor& a, const Tensor& b, const Tensor& A_log, const Tensor& dt_bias) {
  const int64_t M = a.size(0), HV = A_log.numel();
  check_rows(a, "a", M, HV);
  check_rows(b, "b", M, HV);
  check_vec(A_log, "A_log", HV);
  check_vec(dt_bias, "dt_bias", HV);
  auto g = at::empty({M, HV}, a.options()), beta = at::empty({M, HV}, a.options());
  for (int64_t i = 0; i < M; ++i)
    kvstate::dec::gdn_gates_row(a.data_ptr<float>() + i * a.stride(0), b.data_ptr<float>() + i * b.stride(0),
                                A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), HV, g.data_ptr<float>() + i * HV,
                                beta.data_ptr<float>() + i * HV);
  return {g, beta};
}

// dst[i][dst_rows[i]] = src[i][src_rows[i]] for every i, row by row (a row: everything after the first
// dimension): a verify step's rollback, where each layer's pools keep the state after the accepted
// tokens (layers.recurrence.keep_states). One call for every layer and entry, where torch runs an
// index, an index and a copy per row.
void copy_rows(const std::vector<Tensor>& dst, const std::vector<int64_t>& dst_rows, const std::vector<Tensor>& src,
               const std::vector<int64_t>& src_rows) {
  const size_t n = dst.size();
  TORCH_CHECK(dst_rows.size() == n && src.size() == n && src_rows.size() == n,
              "kvstate copy_rows: dst, dst_rows, src and src_rows must have one entry per copy");
  for (size_t i = 0; i < n; ++i) {
    const Tensor &d = dst[i], &s = src[i];
    TORCH_CHECK(d.is_cpu() && s.is_cpu() && d.scalar_type() == s.scalar_type() && d.is_contiguous() &&
                    s.is_contiguous() && d.dim() >= 1 && s.dim() >= 1,
                "kvstate copy_rows: contiguous CPU tensors of one dtype");
    const int64_t row = d.size(0) ? d.numel() / d.size(0) : 0;
    TORCH_CHECK(s.size(0) && s.numel() / s.size(0) == row, "kvstate copy_rows: rows of ", row, " and ",
                s.size(0) ? s.numel() / s.size(0) : 0, " elements");
    TORCH_CHECK(dst_rows[i] >= 0 && dst_rows[i] < d.size(0) && src_rows[i] >= 0 && src_rows[i] < s.size(0),
                "kvstate copy_rows: row ", dst_rows[i], " of ", d.size(0), " <- row ", src_rows[i], " of ", s.size(0));
    const size_t bytes = size_t(row) * d.element_size();
    std::memmove(static_cast<char*>(d.data_ptr()) + dst_rows[i] * bytes,
                static_cast<const char*>(s.data_ptr()) + src_rows[i] * bytes, bytes);
  }
}

Tensor conv_update(const Tensor& x, Tensor pool, const Tensor& slots, const Tensor& w,
                   const c10::optional<Tensor>& bias, bool silu) {
  const int64_t n = x.size(0), D = w.size(0), W = w.size(1);
  check_rows(x, "x", n, D);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kFloat, "kvstate decode: conv weight "
              "must be a contiguous float32 [D, W] tensor");
  check_pool(pool, "conv pool", slots, n);
  TORCH_CHECK(pool.dim() == 3 && pool.size(1) == D && pool.size(2) >= W - 1, "kvstate decode: conv pool must be "
              "[P, ", D, ", >= ", W - 1, "], got ", pool.sizes());
  if (bias.has_value()) check_vec(*bias, "conv bias", D);
  const int64_t S = pool.size(2);
  auto y = at::empty({n, D}, x.options());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t* sl = slots.data_ptr<int64_t>();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, n, grain(D * S * 4), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      kvstate::dec::conv_row(x.data_ptr<float>() + i * x.stride(0), pool.data_ptr<float>() + sl[i] * D * S,
                             w.data_ptr<float>(), bp, D, W, S, silu, y.data_ptr<float>() + i * D);
  });
  return y;
}

// The per-head recurrence over n sequences: qk rows [n, 2, H, K] (row stride qk_stride;
// normalized, q scaled), v rows
// [n, HV * V] (row stride v_stride), decay / beta [n, HV] -> o [n, HV, V]; then, given a norm
// weight, each head's o through the gated RMSNorm with z rows [n, HV * V].
struct HeadArgs {
  const float *qk, *v, *decay, *beta, *z, *norm_w;
  int64_t qk_stride, v_stride, z_stride, H, HV, K, V;
  float norm_eps;
  float* state;
  const int64_t* slots;
  float* o;
  const float* src = nullptr;            // read the states from here (at src_slots) instead of in place
  const int64_t* src_slots = nullptr;
};

void heads(const HeadArgs& a, int64_t n) {
  const int64_t per_key = a.HV / a.H;
  const float* src = a.src == nullptr ? a.state : a.src;
  const int64_t* src_slots = a.src == nullptr ? a.slots : a.src_slots;
  auto read = [&](int64_t j) { return src + (src_slots[j / a.HV] * a.HV + j % a.HV) * a.K * a.V; };  // head j's input
  kvstate::dec::count_gdn_head_call();
  at::parallel_for(0, n * a.HV, grain(a.K * a.V * 4), [&](int64_t j0, int64_t j1) {
    std::vector<float> tmp(2 * a.V);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t i = j / a.HV, h = j % a.HV, kh = h / per_key;
      const float* q = a.qk + i * a.qk_stride + kh * a.K;
      float* o = a.o + j * a.V;
      const float* next = j + 1 < j1 ? read(j + 1) : nullptr;  // the state this thread reads next
      float* S = a.state + (a.slots[i] * a.HV + h) * a.K * a.V;
      const float* S_in = read(j);
      kvstate::dec::gdn_head(S_in, S, q, q + a.H * a.K,
                             a.v + i * a.v_stride + h * a.V, std::exp(a.decay[j]), a.beta[j], a.K, a.V, o,
                             tmp.data(), next);
      if (a.norm_w != nullptr)
        kvstate::dec::gated_rms_norm_row(o, a.z + i * a.z_stride + h * a.V, a.norm_w, a.norm_eps, a.V, o);
    }
  });
}

Tensor gdn_recurrent(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                     Tensor pool, const Tensor& slots, double scale, bool l2) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0),
              "kvstate decode: q, k must be [n, H, K] and v [n, HV, V]");
  const int64_t n = q.size(0), H = q.size(1), K = q.size(2), HV = v.size(1), V = v.size(2);
  TORCH_CHECK(H > 0 && HV % H == 0, "kvstate decode: value heads must be a multiple of key heads");
  check_pool(pool, "state pool", slots, n);
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == HV && pool.size(2) == K && pool.size(3) == V,
              "kvstate decode: state pool must be [P, ", HV, ", ", K, ", ", V, "], got ", pool.sizes());
  auto qk = at::stack({q, k}, 1).to(at::kFloat).contiguous();  // [n, 2, H, K]: ours to normalize
  auto vc = v.to(at::kFloat).contiguous();
  auto gc = g.to(at::kFloat).contiguous(), bc = beta.to(at::kFloat).contiguous();
  TORCH_CHECK(gc.numel() == n * HV && bc.numel() == n * HV, "kvstate decode: g and beta must be [n, HV]");
  auto o = at::empty({n, HV, V}, qk.options());
  pybind11::gil_scoped_release no_gil;
  float* qkp = qk.data_ptr<float>();
  for (int64_t r = 0; r < 2 * n * H; ++r) {
    const bool is_q = (r / H) % 2 == 0;
    if (l2)
      kvstate::dec::l2norm_scale(qkp + r * K, K, is_q ? scale : 1.f);
    else if (is_q)
      for (int64_t c = 0; c < K; ++c) qkp[r * K + c] *= static_cast<float>(scale);
  }
  heads(HeadArgs{qkp, vc.data_ptr<float>(), gc.data_ptr<float>(), bc.data_ptr<float>(), nullptr, nullptr, 2 * H * K,
                 HV * V, 0, H, HV, K, V, 0.f, pool.data_ptr<float>(), slots.data_ptr<int64_t>(), o.data_ptr<float>()},
        n);
  return o;
}

// Gated DeltaNet's sizes from its pools, every argument checked: T token rows of qkv, z, a, b
// [T, 2 H K + HV V | HV V | HV | HV], pools at n `slots`.
struct GdnDims {
  int64_t T, n, HV, K, V, D, W, S;
};

GdnDims check_gdn(const Tensor& qkv, const Tensor& z, const Tensor& a, const Tensor& b, const Tensor& conv_pool,
                  const Tensor& conv_w, const Tensor& state_pool, const Tensor& slots, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_w, int64_t H) {
  TORCH_CHECK(state_pool.dim() == 4, "kvstate decode: state pool must be [P, HV, K, V]");
  GdnDims d{qkv.size(0), slots.numel(), state_pool.size(1), state_pool.size(2), state_pool.size(3), 0, 0, 0};
  d.D = 2 * H * d.K + d.HV * d.V;
  TORCH_CHECK(H > 0 && d.HV % H == 0, "kvstate decode: value heads must be a multiple of key heads");
  check_rows(qkv, "qkv", d.T, d.D);
  check_rows(z, "z", d.T, d.HV * d.V);
  check_rows(a, "a", d.T, d.HV);
  check_rows(b, "b", d.T, d.HV);
  check_vec(A_log, "A_log", d.HV);
  check_vec(dt_bias, "dt_bias", d.HV);
  check_vec(norm_w, "norm weight", d.V);
  check_pool(state_pool, "state pool", slots, d.n);
  check_pool(conv_pool, "conv pool", slots, d.n);
  TORCH_CHECK(conv_w.dim() == 2 && conv_w.size(0) == d.D && conv_w.is_contiguous() &&
                  conv_w.scalar_type() == at::kFloat,
              "kvstate decode: conv weight must be a contiguous float32 [", d.D, ", W] tensor");
  d.W = conv_w.size(1);
  TORCH_CHECK(conv_pool.dim() == 3 && conv_pool.size(1) == d.D && conv_pool.size(2) >= d.W - 1,
              "kvstate decode: conv pool must be [P, ", d.D, ", >= ", d.W - 1, "]");
  d.S = conv_pool.size(2);
  return d;
}

// All of Gated DeltaNet's decode work between in_proj and out_proj, for n sequences of one token:
// conv window update + SiLU, q/k l2norm (q scaled), gates, the state update, the gated RMSNorm.
Tensor gdn_decode(const Tensor& qkv, const Tensor& z, const Tensor& a, const Tensor& b, Tensor conv_pool,
                  const Tensor& conv_w, Tensor state_pool, const Tensor& slots, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_w, double norm_eps, double scale, int64_t H) {
  const GdnDims d = check_gdn(qkv, z, a, b, conv_pool, conv_w, state_pool, slots, A_log, dt_bias, norm_w, H);
  TORCH_CHECK(d.T == d.n, "kvstate decode: one token per slot, got ", d.T, " rows for ", d.n, " slots");
  const int64_t n = d.n, HV = d.HV, K = d.K, V = d.V, D = d.D, W = d.W, S = d.S;
  auto y = at::empty({n, D}, qkv.options());       // conv output: q | k | v
  auto gb = at::empty({2, n, HV}, qkv.options());  // decay (log), beta
  auto o = at::empty({n, HV * V}, qkv.options());
  const int64_t* sl = slots.data_ptr<int64_t>();
  float *yp = y.data_ptr<float>(), *gp = gb.data_ptr<float>();
  pybind11::gil_scoped_release no_gil;
  at::parallel_for(0, n, grain(D * S * 4), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* yi = yp + i * D;
      kvstate::dec::conv_row(qkv.data_ptr<float>() + i * qkv.stride(0), conv_pool.data_ptr<float>() + sl[i] * D * S,
                             conv_w.data_ptr<float>(), nullptr, D, W, S, true, yi);
      for (int64_t r = 0; r < 2 * H; ++r) kvstate::dec::l2norm_scale(yi + r * K, K, r < H ? scale : 1.f);
      kvstate::dec::gdn_gates_row(a.data_ptr<float>() + i * a.stride(0), b.data_ptr<float>() + i * b.stride(0),
                                  A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), HV, gp + i * HV,
                                  gp + (n + i) * HV);
    }
  });
  // qk rows of y are [q heads | k heads] = [2, H, K] per sequence, with row stride D
  HeadArgs args{yp, yp + 2 * H * K, gp, gp + n * HV, z.data_ptr<float>(), norm_w.data_ptr<float>(), D, D, z.stride(0),
                H, HV, K, V, static_cast<float>(norm_eps), state_pool.data_ptr<float>(), sl, o.data_ptr<float>()};
  heads(args, n);
  return o;
}

// Speculative decoding's verify step for Gated DeltaNet: entries of several tokens each (the last
// known token and the drafts, packed by cu_seqlens [n + 1]), each token the decode math above.
// An entry's first token (always kept) updates the pools in place, as a decode does; every later
// token reads the previous token's state (and conv window) and writes its own row of
// states [T, HV, K, V] and windows [T, D, S], returned for the rollback (the rows of first tokens
// are left unwritten). So the pools end at each entry's first token: keeping only it (every draft
// rejected) costs no copy, keeping j > 1 tokens copies row j - 1 (`recurrence.keep_states`).
std::tuple<Tensor, Tensor, Tensor> gdn_verify(const Tensor& qkv, const Tensor& z, const Tensor& a, const Tensor& b,
                                              Tensor conv_pool, const Tensor& conv_w, Tensor state_pool,
                                              const Tensor& slots, const Tensor& cu_seqlens, const Tensor& A_log,
                                              const Tensor& dt_bias, const Tensor& norm_w, double norm_eps,
                                              double scale, int64_t H) {
  const GdnDims d = check_gdn(qkv, z, a, b, conv_pool, conv_w, state_pool, slots, A_log, dt_bias, norm_w, H);
  const int64_t T = d.T, n = d.n, HV = d.HV, K = d.K, V = d.V, D = d.D, W = d.W, S = d.S;
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.is_contiguous() && cu_seqlens.numel() == n + 1,
              "kvstate verify: cu_seqlens must be contiguous int64 [", n + 1, "]");
  const int64_t* cu = cu_seqlens.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[n] == T, "kvstate verify: cu_seqlens must run from 0 to ", T);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(cu[i + 1] > cu[i], "kvstate verify: every entry needs a token");
  const int64_t window_len = D * S;
  auto states = at::empty({T, HV, K, V}, qkv.options()), windows = at::empty({T, D, S}, qkv.options());
  auto y = at::empty({T, D}, qkv.options()), gb = at::empty({2, T, HV}, qkv.options());
  auto o = at::empty({T, HV * V}, qkv.options());
  const int64_t* sl = slots.data_ptr<int64_t>();
  float *yp = y.data_ptr<float>(), *gp = gb.data_ptr<float>(), *st = states.data_ptr<float>();
  float *wn = windows.data_ptr<float>(), *sp = state_pool.data_ptr<float>(), *cp = conv_pool.data_ptr<float>();
  std::vector<int64_t> rows(T);  // token t's state is row t of `states`
  for (int64_t t = 0; t < T; ++t) rows[t] = t;
  pybind11::gil_scoped_release no_gil;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = cu[i]; t < cu[i + 1]; ++t) {
      float* window = cp + sl[i] * window_len;  // the first token shifts the pool's window in place
      if (t > cu[i]) {
        const float* prev = t == cu[i] + 1 ? window : wn + (t - 1) * window_len;
        window = wn + t * window_len;
        std::copy(prev, prev + window_len, window);
      }
      float* yt = yp + t * D;
      kvstate::dec::conv_row(qkv.data_ptr<float>() + t * qkv.stride(0), window, conv_w.data_ptr<float>(),
                             nullptr, D, W, S, true, yt);
      for (int64_t r = 0; r < 2 * H; ++r) kvstate::dec::l2norm_scale(yt + r * K, K, r < H ? scale : 1.f);
      kvstate::dec::gdn_gates_row(a.data_ptr<float>() + t * a.stride(0), b.data_ptr<float>() + t * b.stride(0),
                                  A_log.data_ptr<float>(), dt_bias.data_ptr<float>(), HV, gp + t * HV,
                                  gp + (T + t) * HV);
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t t = cu[i]; t < cu[i + 1]; ++t) {
      // the first token updates the pool's state in place; token t > first reads the state after t - 1
      // (the pool's after the first), writes row t
      const bool first = t == cu[i], second = t == cu[i] + 1;
      HeadArgs args{yp + t * D, yp + t * D + 2 * H * K, gp + t * HV, gp + (T + t) * HV,
                    z.data_ptr<float>() + t * z.stride(0), norm_w.data_ptr<float>(), D, D, z.stride(0), H, HV, K, V,
                    static_cast<float>(norm_eps), first ? sp : st, first ? sl + i : rows.data() + t,
                    o.data_ptr<float>() + t * HV * V};
      if (!first) {
        args.src = second ? sp : st;
        args.src_slots = second ? sl + i : rows.data() + t - 1;
      }
      heads(args, 1);
    }
  }
  return {o, states, windows};
}

}  // namespace

namespace kvstate::op {
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps, double offset) { return ::rms_norm(x, w, eps, offset); }
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& delta, const Tensor& w, double eps,
                                        double offset) {
  return ::add_rms_norm(x, delta, w, eps, offset);
}
Tensor silu_mul(const Tensor& gate, const Tensor& up) { return ::silu_mul(gate, up); }
Tensor gdn_decode(const Tensor& qkv, const Tensor& z, const Tensor& a, const Tensor& b, Tensor conv_pool,
                  const Tensor& conv_w, Tensor state_pool, const Tensor& slots, const Tensor& A_log,
                  const Tensor& dt_bias, const Tensor& norm_w, double norm_eps, double scale, int64_t H) {
  return ::gdn_decode(qkv, z, a, b, conv_pool, conv_w, state_pool, slots, A_log, dt_bias, norm_w, norm_eps, scale, H);
}
std::tuple<Tensor, Tensor, Tensor> gdn_verify(const Tensor& qkv, const Tensor& z, const Tensor& a, const Tensor& b,
                                              Tensor conv_pool, const Tensor& conv_w, Tensor state_pool,
                                              const Tensor& slots, const Tensor& cu_seqlens, const Tensor& A_log,
                                              const Tensor& dt_bias, const Tensor& norm_w, double norm_eps,
                                              double scale, int64_t H) {
  return ::gdn_verify(qkv, z, a, b, conv_pool, conv_w, state_pool, slots, cu_seqlens, A_log, dt_bias, norm_w,
                      norm_eps, scale, H);
}
}  // namespace kvstate::op

namespace kvstate {

void register_decode_ops(pybind11::module_& m) {
  namespace py = pybind11;
  register_decode_attention(m);
  register_decode_blocks(m);
  m.def("rms_norm", &rms_norm, "y[..., D] = x * rsqrt(mean(x^2) + eps) * (w + offset)", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("offset") = 0.0);
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta)) for [M, D] rows", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("offset") = 0.0);
  m.def("silu_mul", &silu_mul, "y[M, N] = silu(gate) * up", py::arg("gate"), py::arg("up"));
  m.def("copy_rows", &copy_rows, "dst[i][dst_rows[i]] = src[i][src_rows[i]] for every i (a row: all after dim 0)",
        py::arg("dst"), py::arg("dst_rows"), py::arg("src"), py::arg("src_rows"));
  m.def("gated_rms_norm", &gated_rms_norm, "y[..., D] = rmsnorm(x) * w * silu(z)", py::arg("x"), py::arg("gate"),
        py::arg("weight"), py::arg("eps"));
  m.def("gdn_gates", &gdn_gates, "(g, beta)[M, HV]: -exp(A_log) softplus(a + dt_bias), sigmoid(b)", py::arg("a"),
        py::arg("b"), py::arg("A_log"), py::arg("dt_bias"));
  m.def("conv_update", &conv_update, "one causal-conv1d step, the pool's windows at slots shifted in place",
        py::arg("x"), py::arg("pool"), py::arg("slots"), py::arg("weight"), py::arg("bias") = py::none(),
        py::arg("silu") = true);
  m.def("gdn_recurrent", &gdn_recurrent, "one gated-delta-rule token per sequence, the pool's states updated in place",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("pool"), py::arg("slots"),
        py::arg("scale"), py::arg("l2") = true);
  m.def("gdn_head_isa", &kvstate::dec::gdn_head_isa, "the gated delta rule's per-head decode kernel: avx512 or avx2");
  m.def("set_gdn_head_isa", &kvstate::dec::set_gdn_head_isa, "choose that kernel (avx512 only where the CPU has it)",
        py::arg("isa"));
  m.def("gdn_decode", &gdn_decode, "Gated DeltaNet between its projections, one token per sequence",
        py::arg("qkv"), py::arg("z"), py::arg("a"), py::arg("b"), py::arg("conv_pool"), py::arg("conv_weight"),
        py::arg("state_pool"), py::arg("slots"), py::arg("A_log"), py::arg("dt_bias"), py::arg("norm_weight"),
        py::arg("norm_eps"), py::arg("scale"), py::arg("num_k_heads"));
  m.def("gdn_verify", &gdn_verify,
        "Gated DeltaNet between its projections for entries of several tokens (speculative verify): "
        "(o [T, HV * V], the state [T, HV, K, V] and conv window [T, D, S] after every token)",
        py::arg("qkv"), py::arg("z"), py::arg("a"), py::arg("b"), py::arg("conv_pool"), py::arg("conv_weight"),
        py::arg("state_pool"), py::arg("slots"), py::arg("cu_seqlens"), py::arg("A_log"), py::arg("dt_bias"),
        py::arg("norm_weight"), py::arg("norm_eps"), py::arg("scale"), py::arg("num_k_heads"));
}

}  // namespace kvstate
