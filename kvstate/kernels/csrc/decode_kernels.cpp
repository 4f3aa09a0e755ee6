// The math of the decode-step ops (see decode_ops.h), on raw fp32 rows. Plain loops that GCC
// vectorizes for AVX2+FMA (the extension only runs on CPUs with at least that; see gemv.cpp):
// the vectors are a few thousand floats and the states a few hundred KiB, so the point is one
// pass over each in cache instead of torch's ~10 ops and temporaries per norm or per head.
#include <cmath>
#include <cstdint>

#include "decode_ops.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace kvstate::dec {

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

inline float sum_sq(const float* x, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

inline float dot(const float* x, const float* y, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
  return s;
}

}  // namespace

void rms_norm_row(const float* x, const float* w, float offset, float eps, int64_t D, float* y) {
  const float r = 1.f / std::sqrt(sum_sq(x, D) / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) y[i] = (x[i] * r) * (w[i] + offset);
}

void gated_rms_norm_row(const float* x, const float* z, const float* w, float eps, int64_t D, float* y) {
  const float r = 1.f / std::sqrt(sum_sq(x, D) / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = (x[i] * r) * w[i] * silu(z[i]);
}

void gdn_gates_row(const float* a, const float* b, const float* A_log, const float* dt_bias, int64_t HV, float* g,
                   float* beta) {
  for (int64_t h = 0; h < HV; ++h) {
    const float x = a[h] + dt_bias[h];
    const float softplus = x > 20.f ? x : std::log1p(std::exp(x));  // torch's threshold
    g[h] = -std::exp(A_log[h]) * softplus;
    beta[h] = 1.f / (1.f + std::exp(-b[h]));
  }
}

void conv_row(const float* x, float* state, const float* w, const float* bias, int64_t D, int64_t W, int64_t S,
              bool act, float* y) {
  const int64_t first = S - (W - 1);  // the window column read by tap 0
  for (int64_t d = 0; d < D; ++d) {
    float* st = state + d * S;
    const float* wd = w + d * W;
    float acc = x[d] * wd[W - 1];
    if (bias != nullptr) acc += bias[d];
    for (int64_t k = 0; k < W - 1; ++k) acc += st[first + k] * wd[k];
    for (int64_t j = 0; j + 1 < S; ++j) st[j] = st[j + 1];
    if (S > 0) st[S - 1] = x[d];
    y[d] = act ? silu(acc) : acc;
  }
}

void l2norm_scale(float* x, int64_t n, float scale) {
  const float f = scale / std::sqrt(sum_sq(x, n) + 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= f;
}

void gdn_head(float* S, const float* q, const float* k, const float* v, float decay, float beta, int64_t K,
              int64_t V, float* o, float* tmp) {
  float* sk = tmp;      // [V]: S^T k, then u
  float* sq = tmp + V;  // [V]: S^T q
  for (int64_t j = 0; j < V; ++j) sk[j] = sq[j] = 0.f;
  // one read of S for both products (with the decayed state S' = decay S:
  // S'^T k = decay S^T k, and S_new^T q = S'^T q + (k . q) u)
  for (int64_t i = 0; i < K; ++i) {
    const float* row = S + i * V;
    const float ki = k[i], qi = q[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) {
      sk[j] += row[j] * ki;
      sq[j] += row[j] * qi;
    }
  }
  const float kq = dot(k, q, K);
#pragma omp simd
  for (int64_t j = 0; j < V; ++j) {
    const float u = beta * (v[j] - decay * sk[j]);
    o[j] = decay * sq[j] + kq * u;
    sk[j] = u;
  }
  // the state is still in cache: S <- decay S + k u^T
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const float ki = k[i];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) row[j] = decay * row[j] + ki * sk[j];
  }
}

}  // namespace kvstate::dec

#pragma GCC pop_options
