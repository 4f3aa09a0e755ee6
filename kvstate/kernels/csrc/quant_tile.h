// The block GEMM, included once per ISA inside its namespace and target pragma (quant_avx512.cpp,
// quant_avx2.cpp) after a `struct Isa` with: V (kLanes floats), zero, load, store, fma, add, mul, sub,
// set1, reduce, u8 / i8 (L bytes -> int32 lanes), cvt, and_, or_, srl, sll, keep, loadu, table16 (a
// lookup in a 16-float table held in 16 / L registers), and kLut with iota / lut16 / lut32 (a table
// lookup of floats by int32 index in one register), kTileRows. The weights are read from memory
// once for all M rows.

static inline float f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static constexpr int L = Isa::L;
using V = typename Isa::V;
using VI = typename Isa::VI;

// Each dequantizer below hands its weights to `sink(off, V of L weights)`, `off` the index of the first
// in the block (a constant once the loops unroll): a store into a buffer, or the FMAs of up to 4 x rows
// straight from the registers.

// codes [L] as floats, times s, minus m: the dequantized weights (no fused multiply-add: ggml rounds
// the product first)
static inline V affine(V q, V s, V m) {
  V p = Isa::mul(s, q);
  Isa::keep(p);
  return Isa::sub(p, m);
}

static inline V scaled(VI q, float s) { return Isa::mul(Isa::set1(s), Isa::cvt(q)); }

template <class Sink>
static inline void deq_q8_0(const uint8_t* b, Sink&& sink) {  // 34 bytes: d, qs int8[32]
  const V d = Isa::set1(f16(b));
#pragma GCC unroll 4
  for (int i = 0; i < 32; i += L) sink(i, Isa::mul(Isa::cvt(Isa::i8(b + 2 + i)), d));
}

template <class Sink>
static inline void deq_q4_0(const uint8_t* b, Sink&& sink) {  // 18 bytes: d, qs[16] (weights j and j + 16)
  const V d = Isa::set1(f16(b));
  const VI eight = Isa::iset1(8);
#pragma GCC unroll 2
  for (int i = 0; i < 16; i += L) {
    const VI q = Isa::u8(b + 2 + i);
    sink(i, Isa::mul(Isa::cvt(Isa::isub(Isa::and_(q, Isa::iset1(15)), eight)), d));
    sink(16 + i, Isa::mul(Isa::cvt(Isa::isub(Isa::srl(q, 4), eight)), d));
  }
}

// the 6-bit scales and mins of the 8 sub-blocks of a Q4_K / Q5_K block (get_scale_min_k4), times d
// and dmin: ds[j] = d * sc_j, dm[j] = dmin * m_j, as ggml rounds them
static inline void scales_mins(const uint8_t* b, float* ds, float* dm) {
  uint32_t u[4];
  k4_scales_mins(b, u);
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u))));
  const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 2))));
  _mm256_store_ps(ds, _mm256_mul_ps(_mm256_set1_ps(f16(b)), sc));
  _mm256_store_ps(dm, _mm256_mul_ps(_mm256_set1_ps(f16(b + 2)), m));
}

// Q4_K (144 bytes: d, dmin, scales[12], qs[128]) or Q5_K (176: d, dmin, scales[12], qh[32], qs[128]).
// Where the ISA can look up 16 (32) floats by index (AVX-512's permutes, which read only the index's
// low 4 (5) bits), a sub-block's 16 (32) possible weights d * sc * q - dmin * m are computed once,
// exactly as above, and each code picks its value: the same weights for fewer operations than
// converting and scaling every code.
template <bool FIVE, class Sink>
static inline void deq_qk(const uint8_t* b, Sink&& sink) {
  alignas(32) float ds[8], dm[8];
  scales_mins(b, ds, dm);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (FIVE ? 48 : 16);
  const VI f = Isa::iset1(15), one = Isa::iset1(1);
  [[maybe_unused]] const V iota0 = Isa::cvt(Isa::iota(0)), iota16 = Isa::cvt(Isa::iota(16));
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const V d0 = Isa::set1(ds[2 * c]), m0 = Isa::set1(dm[2 * c]);
    const V d1 = Isa::set1(ds[2 * c + 1]), m1 = Isa::set1(dm[2 * c + 1]);
    [[maybe_unused]] V t0, t1, u0, u1;  // the lookup tables: codes 0-15 and (Q5_K) 16-31
    if constexpr (Isa::kLut) {
      t0 = affine(iota0, d0, m0), t1 = affine(iota0, d1, m1);
      if constexpr (FIVE) u0 = affine(iota16, d0, m0), u1 = affine(iota16, d1, m1);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 32; i += L) {
      const VI q = Isa::u8(qs + 32 * c + i);
      VI lo = q, hi = Isa::srl(q, 4);
      if constexpr (FIVE || !Isa::kLut) lo = Isa::and_(q, f);
      if constexpr (FIVE) {
        const VI h = Isa::u8(qh + i);
        lo = Isa::or_(lo, Isa::sll(Isa::and_(Isa::srl(h, 2 * c), one), 4));
        hi = Isa::or_(hi, Isa::sll(Isa::and_(Isa::srl(h, 2 * c + 1), one), 4));
      }
      if constexpr (!Isa::kLut) {
        sink(64 * c + i, affine(Isa::cvt(lo), d0, m0));
        sink(64 * c + 32 + i, affine(Isa::cvt(hi), d1, m1));
      } else if constexpr (FIVE) {
        sink(64 * c + i, Isa::lut32(lo, t0, u0));
        sink(64 * c + 32 + i, Isa::lut32(hi, t1, u1));
      } else {
        sink(64 * c + i, Isa::lut16(lo, t0));
        sink(64 * c + 32 + i, Isa::lut16(hi, t1));
      }
    }
  }
}

template <class Sink>
static inline void deq_q6_k(const uint8_t* b, Sink&& sink) {  // 210 bytes: ql[128], qh[64], scales int8[16], d
  const float d = f16(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  alignas(64) float ds[16];
  for (int j = 0; j < 16; j += 8)
    _mm256_store_ps(ds + j, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + j))))));
  const VI m32 = Isa::iset1(32), f = Isa::iset1(15), three = Isa::iset1(3);
#pragma GCC unroll 2
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    const float* s = ds + 8 * half;
    const int o = 128 * half;
#pragma GCC unroll 4
    for (int i = 0; i < 32; i += L) {
      const VI a = Isa::u8(ql + i), c = Isa::u8(ql + 32 + i), h = Isa::u8(qh + i);
      const int is = i / 16;  // with L = 16 one scale per vector; with L = 8 two vectors share it
      const VI q1 = Isa::isub(Isa::or_(Isa::and_(a, f), Isa::sll(Isa::and_(h, three), 4)), m32);
      const VI q2 = Isa::isub(Isa::or_(Isa::and_(c, f), Isa::sll(Isa::and_(Isa::srl(h, 2), three), 4)), m32);
      const VI q3 = Isa::isub(Isa::or_(Isa::srl(a, 4), Isa::sll(Isa::and_(Isa::srl(h, 4), three), 4)), m32);
      const VI q4 = Isa::isub(Isa::or_(Isa::srl(c, 4), Isa::sll(Isa::and_(Isa::srl(h, 6), three), 4)), m32);
      sink(o + i, scaled(q1, s[is]));
      sink(o + 32 + i, scaled(q2, s[is + 2]));
      sink(o + 64 + i, scaled(q3, s[is + 4]));
      sink(o + 96 + i, scaled(q4, s[is + 6]));
    }
  }
}

#include "quant_iq4.h"  // deq_iq4_nl, deq_iq4_xs

template <int TYPE>
struct Block {
  static constexpr int weights = block_weights(TYPE), bytes = block_bytes(TYPE);
};

template <int TYPE, class Sink>
static inline void deq_block(const uint8_t* b, Sink&& sink) {
  if constexpr (TYPE == kQ8_0) deq_q8_0(b, sink);
  else if constexpr (TYPE == kQ4_0) deq_q4_0(b, sink);
  else if constexpr (TYPE == kQ4_K) deq_qk<false>(b, sink);
  else if constexpr (TYPE == kQ5_K) deq_qk<true>(b, sink);
  else if constexpr (TYPE == kIQ4_NL) deq_iq4_nl(b, sink);
  else if constexpr (TYPE == kIQ4_XS) deq_iq4_xs(b, sink);
  else deq_q6_k(b, sink);
}

// every block of a row, each handed to sink(k, off, V): the weights from k + off. The 32-weight
// blocks go two at a time (off 0..63), so a sink may keep several accumulators apart by off.
template <int TYPE, class Sink>
static inline void each_block(const uint8_t* row, int64_t K, Sink&& sink) {
  using B = Block<TYPE>;
  constexpr int step = B::weights == 32 ? 64 : B::weights;
  int64_t k = 0;
  for (; k + step <= K; k += step) {
    const uint8_t* b = row + k / B::weights * B::bytes;
    for (int off = 0; off < (step / B::weights) * B::bytes; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchAhead + off), _MM_HINT_T0);
    deq_block<TYPE>(b, [&](int off, V w) { sink(k, off, w); });
    if constexpr (step == 64) deq_block<TYPE>(b + B::bytes, [&](int off, V w) { sink(k, 32 + off, w); });
  }
  if (k < K) deq_block<TYPE>(row + k / B::weights * B::bytes, [&](int off, V w) { sink(k, off, w); });
}

// x rows [m0, m0 + MT) against W row n, its blocks dequantized in registers; with few x rows each
// keeps several accumulators (by the weights' offset) so the FMAs do not wait on each other
template <int TYPE, int MT>
static void group(const Args& a, int64_t n, int64_t m0) {
  constexpr int NA = MT == 1 ? 4 : MT == 2 ? 2 : 1;
  V acc[MT][NA];
  for (int r = 0; r < MT; ++r)
    for (int s = 0; s < NA; ++s) acc[r][s] = Isa::zero();
  const float* x = a.x + m0 * a.K;
  auto fmas = [&](int64_t k, int off, V w) {
    const int s = (off / L) % NA;
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) acc[r][s] = Isa::fma(w, Isa::load(x + r * a.K + k + off), acc[r][s]);
  };
  each_block<TYPE>(a.w + n * a.row_bytes, a.K, fmas);
  const float b = a.bias ? a.bias[n] : 0.f;
  for (int r = 0; r < MT; ++r) {
    V t = acc[r][0];
    for (int s = 1; s < NA; ++s) t = Isa::add(t, acc[r][s]);
    a.y[(m0 + r) * a.N + n] = Isa::reduce(t) + b;
  }
}

// x rows [m0, m0 + MT) against the 4 W rows from n, dequantized already in deq [4][K]: a register tile
// of 4 x MT accumulators, each x vector loaded once for 4 FMAs (the buffers are read from L1/L2)
template <int MT>
static void tile4(const Args& a, int64_t n, int64_t m0, const float* deq) {
  V acc[4][MT];
  for (int j = 0; j < 4; ++j)
    for (int r = 0; r < MT; ++r) acc[j][r] = Isa::zero();
  const float* x = a.x + m0 * a.K;
  for (int64_t k = 0; k < a.K; k += L) {
    V w[4];
    for (int j = 0; j < 4; ++j) {
      w[j] = Isa::load(deq + j * a.K + k);
      Isa::keep(w[j]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) {
      V xv = Isa::load(x + r * a.K + k);
      Isa::keep(xv);
      for (int j = 0; j < 4; ++j) acc[j][r] = Isa::fma(w[j], xv, acc[j][r]);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const float b = a.bias ? a.bias[n + j] : 0.f;
    for (int r = 0; r < MT; ++r) a.y[(m0 + r) * a.N + n + j] = Isa::reduce(acc[j][r]) + b;
  }
}

template <int TYPE, int MT>
static void rows_in_registers(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) group<TYPE, MT>(a, n, 0);
}

template <int TYPE>
static void rows_of(const Args& a, int64_t n0, int64_t n1) {
  // up to 4 x rows: each W row dequantized in registers, straight into the FMAs of all of them (from 5
  // rows the buffered 4 x kTileRows tile below is faster: 8 rows in registers cost 1.4x it on Zen 4)
  switch (a.M) {
    case 1: return rows_in_registers<TYPE, 1>(a, n0, n1);
    case 2: return rows_in_registers<TYPE, 2>(a, n0, n1);
    case 3: return rows_in_registers<TYPE, 3>(a, n0, n1);
    case 4: return rows_in_registers<TYPE, 4>(a, n0, n1);
    default: break;
  }
  constexpr int kTileRows = Isa::kTileRows;  // x rows of the 4-W-row tile (what the registers hold)
  int64_t n = n0;
  // more rows: 4 W rows at a time are dequantized once into buffers that every pass reads
  std::vector<float> buf(4 * a.K);
  for (; n + 4 <= n1; n += 4) {
    for (int j = 0; j < 4; ++j) {
      float* d = buf.data() + j * a.K;
      each_block<TYPE>(a.w + (n + j) * a.row_bytes, a.K, [&](int64_t k, int off, V w) { Isa::store(d + k + off, w); });
    }
    int64_t m = 0;
    for (; m + kTileRows <= a.M; m += kTileRows) tile4<kTileRows>(a, n, m, buf.data());
    for (; m < a.M; ++m) tile4<1>(a, n, m, buf.data());
  }
  // the last W rows: 4 x rows at a time in registers
  for (; n < n1; ++n) {
    int64_t m = 0;
    for (; m + 4 <= a.M; m += 4) group<TYPE, 4>(a, n, m);
    switch (a.M - m) {
      case 3: group<TYPE, 3>(a, n, m); break;
      case 2: group<TYPE, 2>(a, n, m); break;
      case 1: group<TYPE, 1>(a, n, m); break;
      default: break;
    }
  }
}

// W rows [n0, n1) as fp32 into y [N, K]: each weight exactly as ggml's dequantizer gives it
template <int TYPE>
static void dequantize_of(const Args& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    float* d = a.y + n * a.K;
    each_block<TYPE>(a.w + n * a.row_bytes, a.K, [&](int64_t k, int off, V w) { Isa::store(d + k + off, w); });
  }
}

void dequantize_rows(const Args& a, int64_t n0, int64_t n1) {
  switch (a.type) {
    case kQ8_0: dequantize_of<kQ8_0>(a, n0, n1); break;
    case kQ4_0: dequantize_of<kQ4_0>(a, n0, n1); break;
    case kQ4_K: dequantize_of<kQ4_K>(a, n0, n1); break;
    case kQ5_K: dequantize_of<kQ5_K>(a, n0, n1); break;
    case kIQ4_NL: dequantize_of<kIQ4_NL>(a, n0, n1); break;
    case kIQ4_XS: dequantize_of<kIQ4_XS>(a, n0, n1); break;
    default: dequantize_of<kQ6_K>(a, n0, n1); break;
  }
}

void rows(const Args& a, int64_t n0, int64_t n1) {
  switch (a.type) {
    case kQ8_0: rows_of<kQ8_0>(a, n0, n1); break;
    case kQ4_0: rows_of<kQ4_0>(a, n0, n1); break;
    case kQ4_K: rows_of<kQ4_K>(a, n0, n1); break;
    case kQ5_K: rows_of<kQ5_K>(a, n0, n1); break;
    case kIQ4_NL: rows_of<kIQ4_NL>(a, n0, n1); break;
    case kIQ4_XS: rows_of<kIQ4_XS>(a, n0, n1); break;
    default: rows_of<kQ6_K>(a, n0, n1); break;
  }
}
