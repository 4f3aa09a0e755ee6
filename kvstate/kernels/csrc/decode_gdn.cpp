// The gated delta rule's decode step on one head's state, AVX-512 form, and the run-time choice
// between it and the AVX2 form (decode_kernels.cpp).
//
// The state S [K, V] (fp32, 64 KiB at 128 x 128) is read twice: once for S^T k and S^T q, then,
// with u known, to write decay S + k u^T. With 32 registers a whole row of up to 128 columns
// stays in accumulators (2 x 8), so the first read walks S row by row, in address order: one
// sequential stream the hardware prefetchers follow, two FMAs per loaded vector. The AVX2 form,
// with 16 registers, walks S in blocks of 32 columns instead (strided). The second read finds the
// rows in L1/L2, and meanwhile the next head's state is fetched into L2. On cold states this form
// is faster than the AVX2 one (docs/benchmarks.md, "Kernel history").
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "decode_ops.h"

namespace kvstate::dec {

namespace {
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") != 0;
}

std::atomic<bool> use_avx512{cpu_has_avx512()};
std::atomic<int64_t> calls_avx512{0}, calls_avx2{0};
}  // namespace

std::string gdn_head_isa() { return use_avx512 ? "avx512" : "avx2"; }

std::string gdn_head_isa_within(const std::string& cap) {
  return cap == "avx512" && cpu_has_avx512() ? "avx512" : "avx2";
}

void count_gdn_head_call() { (use_avx512.load(std::memory_order_relaxed) ? calls_avx512 : calls_avx2)++; }

std::vector<std::pair<std::string, int64_t>> gdn_head_calls() {
  return {{"avx512", calls_avx512.load()}, {"avx2", calls_avx2.load()}};
}

void set_gdn_head_isa(const std::string& isa) {
  if (isa != "avx512" && isa != "avx2") throw std::invalid_argument("kvstate decode: isa avx512 or avx2, got " + isa);
  if (isa == "avx512" && !cpu_has_avx512()) throw std::invalid_argument("kvstate decode: this CPU has no AVX-512");
  use_avx512 = isa == "avx512";
}

#pragma GCC push_options
#pragma GCC target("avx512f")

namespace {
constexpr int kMaxVecs = 8;  // 128 columns per chunk: 16 accumulators of the first read

// For the columns [j, j + 16 NV) of S [K, V] (the last vector masked by `last`): S^T k and S^T q,
// then u = beta (v - decay S^T k) and o = decay S^T q + (k . q) u, then out <- decay S + k u^T.
template <int NV>
void chunk(const float* S, float* out, const float* q, const float* k, const float* v, float decay, float beta,
           float kq, int64_t K, int64_t V, int64_t j, __mmask16 last, float* o, const float* next) {
  auto mask = [&](int b) { return b + 1 < NV ? __mmask16(0xFFFF) : last; };
  __m512 ak[NV], aq[NV];
  for (int b = 0; b < NV; ++b) ak[b] = aq[b] = _mm512_setzero_ps();
  const float* row = S + j;
  // The next block's row i is fetched into L2 as this block's row i is read (its first half) and
  // written (its second half): memory keeps streaming through the second read, which needs none.
  auto fetch = [&](int64_t i, int b0, int b1) {
    if (next != nullptr)
      for (int b = b0; b < b1; ++b) _mm_prefetch(reinterpret_cast<const char*>(next + i * V + 16 * b), _MM_HINT_T1);
  };
  for (int64_t i = 0; i < K; ++i, row += V) {
    fetch(i, 0, (NV + 1) / 2);
    const __m512 kb = _mm512_set1_ps(k[i]), qb = _mm512_set1_ps(q[i]);
    for (int b = 0; b < NV; ++b) {
      const __m512 r = _mm512_maskz_loadu_ps(mask(b), row + 16 * b);
      ak[b] = _mm512_fmadd_ps(r, kb, ak[b]);
      aq[b] = _mm512_fmadd_ps(r, qb, aq[b]);
    }
  }
  const __m512 d = _mm512_set1_ps(decay), bt = _mm512_set1_ps(beta), kqv = _mm512_set1_ps(kq);
  __m512 u[NV];
  for (int b = 0; b < NV; ++b) {  // u = beta (v - decay S^T k), o = decay S^T q + (k . q) u
    u[b] = _mm512_mul_ps(bt, _mm512_fnmadd_ps(d, ak[b], _mm512_maskz_loadu_ps(mask(b), v + j + 16 * b)));
    _mm512_mask_storeu_ps(o + j + 16 * b, mask(b), _mm512_fmadd_ps(kqv, u[b], _mm512_mul_ps(d, aq[b])));
  }
  row = S + j;
  float* dst = out + j;
  for (int64_t i = 0; i < K; ++i, row += V, dst += V) {
    fetch(i, (NV + 1) / 2, NV);
    const __m512 kb = _mm512_set1_ps(k[i]);
    for (int b = 0; b < NV; ++b) {
      const __m512 r = _mm512_maskz_loadu_ps(mask(b), row + 16 * b);
      _mm512_mask_storeu_ps(dst + 16 * b, mask(b), _mm512_fmadd_ps(kb, u[b], _mm512_mul_ps(d, r)));
    }
  }
}

void gdn_head_avx512(const float* S, float* out, const float* q, const float* k, const float* v, float decay,
                     float beta, int64_t K, int64_t V, float* o, const float* next) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= K; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(k + i), _mm512_loadu_ps(q + i), acc);
  float kq = _mm512_reduce_add_ps(acc);
  for (; i < K; ++i) kq += k[i] * q[i];
  for (int64_t j = 0; j < V; j += 16 * kMaxVecs) {
    const int64_t cols = std::min<int64_t>(V - j, 16 * kMaxVecs), nv = (cols + 15) / 16;
    const __mmask16 last = __mmask16((1u << (cols - 16 * (nv - 1))) - 1);
    const float* after = j + cols < V ? S + j + cols : next;  // what the first read takes next
    switch (nv) {
      case 1: chunk<1>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
      case 2: chunk<2>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
      case 3: chunk<3>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
      case 4: chunk<4>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
      case 5: chunk<5>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
      case 6: chunk<6>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
      case 7: chunk<7>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
      default: chunk<8>(S, out, q, k, v, decay, beta, kq, K, V, j, last, o, after); break;
    }
  }
}
}  // namespace

#pragma GCC pop_options

void gdn_head(const float* S, float* out, const float* q, const float* k, const float* v, float decay, float beta,
              int64_t K, int64_t V, float* o, float* tmp, const float* next) {
  if (use_avx512.load(std::memory_order_relaxed))
    gdn_head_avx512(S, out, q, k, v, decay, beta, K, V, o, next);
  else
    gdn_head_avx2(S, out, q, k, v, decay, beta, K, V, o, tmp, next);
}

}  // namespace kvstate::dec
