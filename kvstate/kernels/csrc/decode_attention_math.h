// The arithmetic of the attention decode kernel (decode_attention.cpp): dot products of the query
// heads with one or two keys, and the value rows accumulated into the output with the accumulators
// in registers. Deliberately no includes and no namespace: included once, inside that file's
// anonymous namespace and its AVX2 `#pragma GCC target` region, after <immintrin.h>.

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

float dot(const float* x, const float* y, int64_t n) {  // four chains: an FMA's latency is 4+ cycles
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(y + i + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(y + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

// out[g] = q_g . kp for the G query rows of one KV head (q [G, D]): each key loaded once, G chains.
template <int G>
void dots(const float* q, const float* kp, int64_t D, float* out) {
  __m256 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= D; c += 8) {
    const __m256 kv = _mm256_loadu_ps(kp + c);
    for (int g = 0; g < G; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c), kv, acc[g]);
  }
  for (int g = 0; g < G; ++g) {
    float s = hsum(acc[g]);
    for (int64_t r = c; r < D; ++r) s += q[g * D + r] * kp[r];
    out[g] = s;
  }
}

void dots_any(const float* q, int64_t G, const float* kp, int64_t D, float* out) {
  switch (G) {
    case 1: return dots<1>(q, kp, D, out);
    case 2: return dots<2>(q, kp, D, out);
    case 4: return dots<4>(q, kp, D, out);
    case 8: return dots<8>(q, kp, D, out);
    default:
      for (int64_t g = 0; g < G; ++g) out[g] = dot(q + g * D, kp, D);
  }
}

// Two keys at once (out0[g] = q_g . k0, out1[g] = q_g . k1): twice the independent FMA chains of
// `dots`, each q vector loaded once for both (G <= 4: 2 G accumulators).
template <int G>
void dots2(const float* q, const float* k0, const float* k1, int64_t D, float* out0, float* out1) {
  __m256 a0[G], a1[G];
  for (int g = 0; g < G; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= D; c += 8) {
    const __m256 x0 = _mm256_loadu_ps(k0 + c), x1 = _mm256_loadu_ps(k1 + c);
    for (int g = 0; g < G; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * D + c);
      a0[g] = _mm256_fmadd_ps(qv, x0, a0[g]);
      a1[g] = _mm256_fmadd_ps(qv, x1, a1[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    float s0 = hsum(a0[g]), s1 = hsum(a1[g]);
    for (int64_t r = c; r < D; ++r) s0 += q[g * D + r] * k0[r], s1 += q[g * D + r] * k1[r];
    out0[g] = s0, out1[g] = s1;
  }
}

// o[g, c:c+8W] += sum over the block's nt rows of p[g][s] * v_s[c:c+8W], the G x W accumulators in
// registers for the whole block (v rows `vstride` floats apart, p rows L apart).
template <int G, int W>
inline void accumulate(const float* v, int64_t vstride, int64_t nt, const float* p, int64_t L, float* o, int64_t Dv) {
  __m256 acc[G][W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) acc[g][w] = _mm256_loadu_ps(o + g * Dv + 8 * w);
  for (int64_t s = 0; s < nt; ++s) {
    __m256 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = _mm256_loadu_ps(v + s * vstride + 8 * w);
    for (int g = 0; g < G; ++g) {
      const __m256 pv = _mm256_broadcast_ss(p + g * L + s);
      for (int w = 0; w < W; ++w) acc[g][w] = _mm256_fmadd_ps(pv, vv[w], acc[g][w]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(o + g * Dv + 8 * w, acc[g][w]);
}

// o [G, Dv] += p [G, L] (columns t0..t0+nt) times the block's value rows: whole chunks of 8 W
// channels in registers (W = 2 up to 4 heads, 1 for 8), the rest of Dv one channel at a time.
template <int G>
void values_block(const float* v, int64_t vstride, int64_t nt, const float* p, int64_t L, float* o, int64_t Dv) {
  constexpr int W = G <= 4 ? 2 : 1;
  int64_t c = 0;
  for (; c + 8 * W <= Dv; c += 8 * W) accumulate<G, W>(v + c, vstride, nt, p, L, o + c, Dv);
  for (; c < Dv; ++c)
    for (int64_t s = 0; s < nt; ++s)
      for (int g = 0; g < G; ++g) o[g * Dv + c] += p[g * L + s] * v[s * vstride + c];
}

void values_block_any(int64_t G, const float* v, int64_t vstride, int64_t nt, const float* p, int64_t L, float* o,
                      int64_t Dv) {
  switch (G) {
    case 1: return values_block<1>(v, vstride, nt, p, L, o, Dv);
    case 2: return values_block<2>(v, vstride, nt, p, L, o, Dv);
    case 4: return values_block<4>(v, vstride, nt, p, L, o, Dv);
    case 8: return values_block<8>(v, vstride, nt, p, L, o, Dv);
    default:
      for (int64_t g = 0; g < G; ++g) values_block<1>(v, vstride, nt, p + g * L, L, o + g * Dv, Dv);
  }
}
