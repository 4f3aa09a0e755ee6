// The math of the decode-step ops (see decode_ops.h), on raw fp32 rows, for AVX2+FMA (the
// extension only runs on CPUs with at least that; see gemv.cpp). The vectors are a few thousand
// floats and a layer's states a MiB per sequence: the point is one pass over each, in cache,
// instead of torch's ~10 ops and temporaries per norm or per head. The state update keeps its
// partial products in registers (a plain loop over them is compute-bound, not memory-bound),
// and SiLU uses a vectorized exp (Cephes' polynomial, within 2 ulp of expf).
#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "decode_ops.h"
#include "simd_math.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace kvstate::dec {

namespace {

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

// y[i] = silu(x[i]) * f[i] (f may be nullptr: 1), y may alias x
inline void silu_rows(const float* x, const float* f, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 s = silu8(_mm256_loadu_ps(x + i));
    if (f != nullptr) s = _mm256_mul_ps(s, _mm256_loadu_ps(f + i));
    _mm256_storeu_ps(y + i, s);
  }
  for (; i < n; ++i) y[i] = silu(x[i]) * (f != nullptr ? f[i] : 1.f);
}

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

// The conv step with the window sizes fixed at compile time (the loops unroll); W = 4 is what
// every supported family uses, with S = W (the default windows) or W - 1.
template <int W, int S>
void conv_fixed(const float* x, float* state, const float* w, const float* bias, int64_t D, float* y) {
  constexpr int first = S - (W - 1);
  for (int64_t d = 0; d < D; ++d) {
    float* st = state + d * S;
    const float* wd = w + d * W;
    float acc = x[d] * wd[W - 1];
    if (bias != nullptr) acc += bias[d];
#pragma GCC unroll 8
    for (int k = 0; k < W - 1; ++k) acc += st[first + k] * wd[k];
#pragma GCC unroll 8
    for (int j = 0; j + 1 < S; ++j) st[j] = st[j + 1];
    st[S - 1] = x[d];
    y[d] = acc;
  }
}

}  // namespace

void rms_norm_row(const float* x, const float* w, float offset, float eps, int64_t D, float* y) {
  const float r = 1.f / std::sqrt(sum_sq(x, D) / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) y[i] = (x[i] * r) * (w[i] + offset);
}

void add_rms_norm_row(const float* x, const float* delta, const float* w, float offset, float eps, int64_t D,
                      float* sum, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) sum[i] = x[i] + delta[i];
  rms_norm_row(sum, w, offset, eps, D, y);
}

void silu_mul_row(const float* gate, const float* up, int64_t N, float* y) { silu_rows(gate, up, N, y); }

void gated_rms_norm_row(const float* x, const float* z, const float* w, float eps, int64_t D, float* y) {
  const float r = 1.f / std::sqrt(sum_sq(x, D) / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) y[i] = (x[i] * r) * w[i];
  silu_rows(z, y, D, y);
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

// W = S = 4, 8 channels at a time: their windows and taps [8, 4] are transposed to 4 column
// vectors (channel order 0 2 4 6 1 3 5 7, undone for y), combined, and the shifted windows
// transposed back. Returns the channels done (a multiple of 8); the caller does the rest.
int64_t conv_w4s4(const float* x, float* state, const float* w, const float* bias, int64_t D, float* y) {
  const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), unperm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto columns = [](const float* p, __m256 c[4]) {
    const __m256 A = _mm256_loadu_ps(p), B = _mm256_loadu_ps(p + 8), C = _mm256_loadu_ps(p + 16),
                 Dd = _mm256_loadu_ps(p + 24);
    const __m256 t0 = _mm256_unpacklo_ps(A, B), t1 = _mm256_unpackhi_ps(A, B);
    const __m256 t2 = _mm256_unpacklo_ps(C, Dd), t3 = _mm256_unpackhi_ps(C, Dd);
    c[0] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    c[1] = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    c[2] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    c[3] = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  };
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    float* st = state + d * 4;
    __m256 s[4], wc[4];
    columns(st, s);
    columns(w + d * 4, wc);
    const __m256 xp = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + d), perm);
    __m256 acc = _mm256_mul_ps(xp, wc[3]);
    if (bias != nullptr) acc = _mm256_add_ps(acc, _mm256_permutevar8x32_ps(_mm256_loadu_ps(bias + d), perm));
    acc = _mm256_fmadd_ps(s[1], wc[0], acc);
    acc = _mm256_fmadd_ps(s[2], wc[1], acc);
    acc = _mm256_fmadd_ps(s[3], wc[2], acc);
    _mm256_storeu_ps(y + d, _mm256_permutevar8x32_ps(acc, unperm));
    // the windows shifted: columns s1 s2 s3 x, transposed back to [8, 4]
    const __m256 u0 = _mm256_unpacklo_ps(s[1], s[2]), u1 = _mm256_unpacklo_ps(s[3], xp);
    const __m256 u2 = _mm256_unpackhi_ps(s[1], s[2]), u3 = _mm256_unpackhi_ps(s[3], xp);
    _mm256_storeu_ps(st, _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(st + 8, _mm256_shuffle_ps(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_storeu_ps(st + 16, _mm256_shuffle_ps(u2, u3, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_storeu_ps(st + 24, _mm256_shuffle_ps(u2, u3, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return d;
}

void conv_row(const float* x, float* state, const float* w, const float* bias, int64_t D, int64_t W, int64_t S,
              bool act, float* y) {
  if (W == 4 && S == 4) {
    const int64_t d = conv_w4s4(x, state, w, bias, D, y);
    conv_fixed<4, 4>(x + d, state + d * 4, w + d * 4, bias == nullptr ? nullptr : bias + d, D - d, y + d);
  } else if (W == 4 && S == 3) {
    conv_fixed<4, 3>(x, state, w, bias, D, y);
  } else {
    const int64_t first = S - (W - 1);  // the window column read by tap 0
    for (int64_t d = 0; d < D; ++d) {
      float* st = state + d * S;
      const float* wd = w + d * W;
      float acc = x[d] * wd[W - 1];
      if (bias != nullptr) acc += bias[d];
      for (int64_t k = 0; k < W - 1; ++k) acc += st[first + k] * wd[k];
      for (int64_t j = 0; j + 1 < S; ++j) st[j] = st[j + 1];
      if (S > 0) st[S - 1] = x[d];
      y[d] = acc;
    }
  }
  if (act) silu_rows(y, nullptr, D, y);
}

void l2norm_scale(float* x, int64_t n, float scale) {
  const float f = scale / std::sqrt(sum_sq(x, n) + 1e-6f);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) x[i] *= f;
}

// S^T k and S^T q for the columns [j, j + 8 * B) of S [K, V], in 2 * B registers. The first
// block (`fetch`) also prefetches whole rows a few ahead: the blocks walk S column-wise, which
// the hardware prefetchers follow badly (a cold state took twice as long as a cached one).
template <int B>
inline void read_cols(const float* S, const float* q, const float* k, int64_t K, int64_t V, int64_t j, float* sk,
                      float* sq, bool fetch) {
  constexpr int64_t kAhead = 6;  // rows
  __m256 ak[B], aq[B];
  for (int b = 0; b < B; ++b) ak[b] = aq[b] = _mm256_setzero_ps();
  for (int64_t i = 0; i < K; ++i) {
    const float* row = S + i * V + j;
    if (fetch)
      for (int64_t c = 0; c < V; c += 16)
        _mm_prefetch(reinterpret_cast<const char*>(S + (i + kAhead) * V + c), _MM_HINT_T0);
    const __m256 kb = _mm256_set1_ps(k[i]), qb = _mm256_set1_ps(q[i]);
    for (int b = 0; b < B; ++b) {
      const __m256 r = _mm256_loadu_ps(row + 8 * b);
      ak[b] = _mm256_fmadd_ps(r, kb, ak[b]);
      aq[b] = _mm256_fmadd_ps(r, qb, aq[b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    _mm256_storeu_ps(sk + j + 8 * b, ak[b]);
    _mm256_storeu_ps(sq + j + 8 * b, aq[b]);
  }
}

void gdn_head_avx2(const float* S, float* out, const float* q, const float* k, const float* v, float decay,
                   float beta, int64_t K, int64_t V, float* o, float* tmp, const float* next) {
  float* sk = tmp;      // [V]: S^T k, then u
  float* sq = tmp + V;  // [V]: S^T q
  // one read of S for both products (with the decayed state S' = decay S:
  // S'^T k = decay S^T k, and S_new^T q = S'^T q + (k . q) u)
  int64_t j = 0;
  for (; j + 32 <= V; j += 32) read_cols<4>(S, q, k, K, V, j, sk, sq, j == 0);
  for (; j + 8 <= V; j += 8) read_cols<1>(S, q, k, K, V, j, sk, sq, j == 0);
  for (; j < V; ++j) {
    float a = 0.f, b = 0.f;
    for (int64_t i = 0; i < K; ++i) {
      a += S[i * V + j] * k[i];
      b += S[i * V + j] * q[i];
    }
    sk[j] = a;
    sq[j] = b;
  }
  const float kq = dot(k, q, K);
#pragma omp simd
  for (int64_t c = 0; c < V; ++c) {
    const float u = beta * (v[c] - decay * sk[c]);
    o[c] = decay * sq[c] + kq * u;
    sk[c] = u;
  }
  // the state is still in cache: out <- decay S + k u^T; meanwhile the next head's state comes in
  for (int64_t i = 0; i < K; ++i) {
    const float* row = S + i * V;
    float* dst = out + i * V;
    const float ki = k[i];
    if (next != nullptr)
      for (int64_t c = 0; c < V; c += 16) _mm_prefetch(reinterpret_cast<const char*>(next + i * V + c), _MM_HINT_T0);
#pragma omp simd
    for (int64_t c = 0; c < V; ++c) dst[c] = decay * row[c] + ki * sk[c];
  }
}

}  // namespace kvstate::dec

#pragma GCC pop_options
