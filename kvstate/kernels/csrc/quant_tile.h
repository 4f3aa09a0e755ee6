// The block GEMM, included once per ISA inside its namespace and target pragma (quant_avx512.cpp,
// quant_avx2.cpp) after a `struct Isa` with: V (kLanes floats), zero, load, store, fma, add, mul, sub,
// set1, reduce, u8 / i8 (L bytes -> int32 lanes), cvt, and_, or_, srl, sll, keep, and kLut with
// iota / lut16 / lut32 (a table lookup of floats by int32 index), kTileRows. The weights are read from memory
// once for all M rows.

static inline float f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static constexpr int L = Isa::L;
using V = typename Isa::V;
using VI = typename Isa::VI;

// Each dequantizer below hands its weights to `sink(offset in the block, V of L weights)`: a store
// into a buffer, or the FMAs of up to 4 x rows straight from the registers.

// codes [L] as floats, times s, minus m: the dequantized weights (no fused multiply-add: ggml rounds
// the product first)
static inline V affine(VI q, float s, float m) {
  V p = Isa::mul(Isa::set1(s), Isa::cvt(q));
  Isa::keep(p);
  return Isa::sub(p, Isa::set1(m));
}

static inline V scaled(VI q, float s) { return Isa::mul(Isa::set1(s), Isa::cvt(q)); }

template <class Sink>
static inline void deq_q8_0(const uint8_t* b, Sink&& sink) {  // 34 bytes: d, qs int8[32]
  const float d = f16(b);
  for (int i = 0; i < 32; i += L) sink(i, Isa::mul(Isa::cvt(Isa::i8(b + 2 + i)), Isa::set1(d)));
}

template <class Sink>
static inline void deq_q4_0(const uint8_t* b, Sink&& sink) {  // 18 bytes: d, qs[16] (weights j and j + 16)
  const float d = f16(b);
  const VI eight = Isa::iset1(8);
  for (int i = 0; i < 16; i += L) {
    const VI q = Isa::u8(b + 2 + i);
    sink(i, Isa::mul(Isa::cvt(Isa::isub(Isa::and_(q, Isa::iset1(15)), eight)), Isa::set1(d)));
    sink(16 + i, Isa::mul(Isa::cvt(Isa::isub(Isa::srl(q, 4), eight)), Isa::set1(d)));
  }
}

// the 6-bit scale and min of sub-block j of a Q4_K / Q5_K block (get_scale_min_k4)
static inline void scale_min(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (144 bytes: d, dmin, scales[12], qs[128]) or Q5_K (176: d, dmin, scales[12], qh[32], qs[128]).
// Where the ISA can look up 16 (32) floats by index (AVX-512's permutes), a sub-block's 16 (32)
// possible weights d * sc * q - dmin * m are computed once, exactly as above, and each code picks
// its value: the same weights for fewer operations than converting and scaling every code.
template <bool FIVE, class Sink>
static inline void deq_qk(const uint8_t* b, Sink&& sink) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (FIVE ? 48 : 16);
  for (int c = 0; c < 4; ++c) {
    int sc0, m0, sc1, m1;
    scale_min(2 * c, scales, sc0, m0);
    scale_min(2 * c + 1, scales, sc1, m1);
    const float d0 = d * float(sc0), dm0 = dmin * float(m0), d1 = d * float(sc1), dm1 = dmin * float(m1);
    [[maybe_unused]] V t0, t1, u0, u1;  // the lookup tables: codes 0-15 and (Q5_K) 16-31
    if constexpr (Isa::kLut) {
      t0 = affine(Isa::iota(0), d0, dm0), t1 = affine(Isa::iota(0), d1, dm1);
      u0 = FIVE ? affine(Isa::iota(16), d0, dm0) : t0, u1 = FIVE ? affine(Isa::iota(16), d1, dm1) : t1;
    }
    for (int i = 0; i < 32; i += L) {
      const VI q = Isa::u8(qs + 32 * c + i);
      VI lo = Isa::and_(q, Isa::iset1(15)), hi = Isa::srl(q, 4);
      if constexpr (FIVE) {
        const VI h = Isa::u8(qh + i);
        lo = Isa::or_(lo, Isa::sll(Isa::and_(Isa::srl(h, 2 * c), Isa::iset1(1)), 4));
        hi = Isa::or_(hi, Isa::sll(Isa::and_(Isa::srl(h, 2 * c + 1), Isa::iset1(1)), 4));
      }
      if constexpr (!Isa::kLut) {
        sink(64 * c + i, affine(lo, d0, dm0));
        sink(64 * c + 32 + i, affine(hi, d1, dm1));
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
  const VI m32 = Isa::iset1(32), f = Isa::iset1(15), three = Isa::iset1(3);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    const int8_t* s = sc + 8 * half;
    const int o = 128 * half;
    for (int i = 0; i < 32; i += L) {
      const VI a = Isa::u8(ql + i), c = Isa::u8(ql + 32 + i), h = Isa::u8(qh + i);
      const int is = i / 16;  // with L = 16 one scale per vector; with L = 8 two vectors share it
      const VI q1 = Isa::isub(Isa::or_(Isa::and_(a, f), Isa::sll(Isa::and_(h, three), 4)), m32);
      const VI q2 = Isa::isub(Isa::or_(Isa::and_(c, f), Isa::sll(Isa::and_(Isa::srl(h, 2), three), 4)), m32);
      const VI q3 = Isa::isub(Isa::or_(Isa::srl(a, 4), Isa::sll(Isa::and_(Isa::srl(h, 4), three), 4)), m32);
      const VI q4 = Isa::isub(Isa::or_(Isa::srl(c, 4), Isa::sll(Isa::and_(Isa::srl(h, 6), three), 4)), m32);
      sink(o + i, scaled(q1, d * float(s[is])));
      sink(o + 32 + i, scaled(q2, d * float(s[is + 2])));
      sink(o + 64 + i, scaled(q3, d * float(s[is + 4])));
      sink(o + 96 + i, scaled(q4, d * float(s[is + 6])));
    }
  }
}

// every block of a row, each handed to sink(weight index in the row, V)
template <int TYPE, class Sink>
static inline void each_block(const uint8_t* row, int64_t K, Sink&& sink) {
  constexpr int bw = TYPE == kQ8_0 || TYPE == kQ4_0 ? 32 : 256;
  constexpr int bb = TYPE == kQ8_0 ? 34 : TYPE == kQ4_0 ? 18 : TYPE == kQ4_K ? 144 : TYPE == kQ5_K ? 176 : 210;
  for (int64_t k = 0; k < K; k += bw) {
    const uint8_t* b = row + k / bw * bb;
    auto at = [&](int off, V w) { sink(k + off, w); };
    if constexpr (TYPE == kQ8_0) deq_q8_0(b, at);
    else if constexpr (TYPE == kQ4_0) deq_q4_0(b, at);
    else if constexpr (TYPE == kQ4_K) deq_qk<false>(b, at);
    else if constexpr (TYPE == kQ5_K) deq_qk<true>(b, at);
    else deq_q6_k(b, at);
  }
}

// x rows [m0, m0 + MT) against W row n, its blocks dequantized in registers
template <int TYPE, int MT>
static void group(const Args& a, int64_t n, int64_t m0) {
  V acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = Isa::zero();
  const float* x = a.x + m0 * a.K;
  auto fmas = [&](int64_t k, V w) {
#pragma GCC unroll 4
    for (int r = 0; r < MT; ++r) acc[r] = Isa::fma(w, Isa::load(x + r * a.K + k), acc[r]);
  };
  each_block<TYPE>(a.w + n * a.row_bytes, a.K, fmas);
  const float b = a.bias ? a.bias[n] : 0.f;
  for (int r = 0; r < MT; ++r) a.y[(m0 + r) * a.N + n] = Isa::reduce(acc[r]) + b;
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

template <int TYPE>
static void rows_of(const Args& a, int64_t n0, int64_t n1) {
  constexpr int kTile = 4;  // x rows per pass over a W row
  constexpr int kTileRows = Isa::kTileRows;  // x rows of the 4-W-row tile (what the registers hold)
  int64_t n = n0;
  if (a.M > kTile) {
    // more rows: 4 W rows at a time are dequantized once into buffers that every pass reads
    std::vector<float> buf(4 * a.K);
    for (; n + 4 <= n1; n += 4) {
      for (int j = 0; j < 4; ++j) {
        float* d = buf.data() + j * a.K;
        each_block<TYPE>(a.w + (n + j) * a.row_bytes, a.K, [&](int64_t k, V w) { Isa::store(d + k, w); });
      }
      int64_t m = 0;
      for (; m + kTileRows <= a.M; m += kTileRows) tile4<kTileRows>(a, n, m, buf.data());
      for (; m < a.M; ++m) tile4<1>(a, n, m, buf.data());
    }
  }
  // up to 4 rows (and the last W rows): dequantized in registers, straight into the FMAs
  for (; n < n1; ++n) {
    int64_t m = 0;
    for (; m + kTile <= a.M; m += kTile) group<TYPE, kTile>(a, n, m);
    switch (a.M - m) {
      case 3: group<TYPE, 3>(a, n, m); break;
      case 2: group<TYPE, 2>(a, n, m); break;
      case 1: group<TYPE, 1>(a, n, m); break;
      default: break;
    }
  }
}

void rows(const Args& a, int64_t n0, int64_t n1) {
  switch (a.type) {
    case kQ8_0: rows_of<kQ8_0>(a, n0, n1); break;
    case kQ4_0: rows_of<kQ4_0>(a, n0, n1); break;
    case kQ4_K: rows_of<kQ4_K>(a, n0, n1); break;
    case kQ5_K: rows_of<kQ5_K>(a, n0, n1); break;
    default: rows_of<kQ6_K>(a, n0, n1); break;
  }
}
