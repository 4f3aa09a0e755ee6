// The block GEMM, included once per ISA inside its namespace and target pragma (quant_avx512.cpp,
// quant_avx2.cpp) after a `struct Isa` with: V (kLanes floats), zero, load, store, fma, add, mul, sub,
// set1, reduce, u8 (kLanes bytes -> int32 lanes), cvt (int32 lanes -> floats), and_, srl, keep.
// Per W row: each chunk of up to 256 weights is dequantized into an L1 buffer, then every x row's
// accumulator takes its FMAs from the buffer (the weights are read from memory once for all M rows).

static inline float f16(const uint8_t* p) {
  uint16_t h;
  __builtin_memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static constexpr int L = Isa::L;
using V = typename Isa::V;
using VI = typename Isa::VI;

// codes [L] as floats, times s, minus m: the dequantized weights (no fused multiply-add: ggml rounds
// the product first)
static inline V affine(VI q, float s, float m) {
  V p = Isa::mul(Isa::set1(s), Isa::cvt(q));
  Isa::keep(p);
  return Isa::sub(p, Isa::set1(m));
}

static inline V scaled(VI q, float s) { return Isa::mul(Isa::set1(s), Isa::cvt(q)); }

// 32 weights of a Q8_0 / Q4_0 block
static void deq_q8_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  for (int i = 0; i < 32; i += L) Isa::store(out + i, Isa::mul(Isa::cvt(Isa::i8(b + 2 + i)), Isa::set1(d)));
}
static void deq_q4_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  for (int i = 0; i < 16; i += L) {
    const VI q = Isa::u8(b + 2 + i);
    const VI eight = Isa::iset1(8);
    Isa::store(out + i, Isa::mul(Isa::cvt(Isa::isub(Isa::and_(q, Isa::iset1(15)), eight)), Isa::set1(d)));
    Isa::store(out + 16 + i, Isa::mul(Isa::cvt(Isa::isub(Isa::srl(q, 4), eight)), Isa::set1(d)));
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

static void deq_qk(const uint8_t* b, float* out, bool five) {  // Q4_K (144 bytes) or Q5_K (176)
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + (five ? 48 : 16);
  for (int c = 0; c < 4; ++c) {
    int sc0, m0, sc1, m1;
    scale_min(2 * c, scales, sc0, m0);
    scale_min(2 * c + 1, scales, sc1, m1);
    const float d0 = d * float(sc0), dm0 = dmin * float(m0), d1 = d * float(sc1), dm1 = dmin * float(m1);
    for (int i = 0; i < 32; i += L) {
      const VI q = Isa::u8(qs + 32 * c + i);
      VI lo = Isa::and_(q, Isa::iset1(15)), hi = Isa::srl(q, 4);
      if (five) {
        const VI h = Isa::u8(qh + i);
        lo = Isa::or_(lo, Isa::sll(Isa::and_(Isa::srl(h, 2 * c), Isa::iset1(1)), 4));
        hi = Isa::or_(hi, Isa::sll(Isa::and_(Isa::srl(h, 2 * c + 1), Isa::iset1(1)), 4));
      }
      Isa::store(out + 64 * c + i, affine(lo, d0, dm0));
      Isa::store(out + 64 * c + 32 + i, affine(hi, d1, dm1));
    }
  }
}

static void deq_q6_k(const uint8_t* b, float* out) {  // 210 bytes: ql[128], qh[64], scales int8[16], d
  const float d = f16(b + 208);
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = b + 64 * half;
    const uint8_t* qh = b + 128 + 32 * half;
    float* o = out + 128 * half;
    const int8_t* s = sc + 8 * half;
    const VI m32 = Isa::iset1(32), f = Isa::iset1(15), three = Isa::iset1(3);
    for (int i = 0; i < 32; i += L) {
      const VI a = Isa::u8(ql + i), c = Isa::u8(ql + 32 + i), h = Isa::u8(qh + i);
      const int is = i / 16;  // with L = 16 one scale per vector; with L = 8 two vectors share it
      const VI q1 = Isa::isub(Isa::or_(Isa::and_(a, f), Isa::sll(Isa::and_(h, three), 4)), m32);
      const VI q2 = Isa::isub(Isa::or_(Isa::and_(c, f), Isa::sll(Isa::and_(Isa::srl(h, 2), three), 4)), m32);
      const VI q3 = Isa::isub(Isa::or_(Isa::srl(a, 4), Isa::sll(Isa::and_(Isa::srl(h, 4), three), 4)), m32);
      const VI q4 = Isa::isub(Isa::or_(Isa::srl(c, 4), Isa::sll(Isa::and_(Isa::srl(h, 6), three), 4)), m32);
      Isa::store(o + i, scaled(q1, d * float(s[is])));
      Isa::store(o + 32 + i, scaled(q2, d * float(s[is + 2])));
      Isa::store(o + 64 + i, scaled(q3, d * float(s[is + 4])));
      Isa::store(o + 96 + i, scaled(q4, d * float(s[is + 6])));
    }
  }
}

// dequantize the weights [k0, k0 + n) of one row (k0 and n multiples of the block) into out
static void dequant_chunk(int type, const uint8_t* row, int64_t k0, int64_t n, float* out) {
  const int bw = block_weights(type), bb = block_bytes(type);
  for (int64_t k = 0; k < n; k += bw) {
    const uint8_t* b = row + (k0 + k) / bw * bb;
    switch (type) {
      case kQ8_0: deq_q8_0(b, out + k); break;
      case kQ4_0: deq_q4_0(b, out + k); break;
      case kQ4_K: deq_qk(b, out + k, false); break;
      case kQ5_K: deq_qk(b, out + k, true); break;
      default: deq_q6_k(b, out + k); break;
    }
  }
}

// x rows [m0, m0 + MT) against the buffer's n weights (from column k0): acc[r] += buf * x[r]
template <int MT>
static inline void dot_chunk(const Args& a, int64_t m0, int64_t k0, int64_t n, const float* buf, V* acc) {
  const float* x = a.x + m0 * a.K + k0;
  for (int64_t i = 0; i < n; i += L) {
    V w = Isa::load(buf + i);
    Isa::keep(w);
#pragma GCC unroll 8
    for (int r = 0; r < MT; ++r) acc[r] = Isa::fma(w, Isa::load(x + r * a.K + i), acc[r]);
  }
}

template <int MT>
static void group(const Args& a, int64_t n, int64_t m0, const float* deq, bool whole) {
  V acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = Isa::zero();
  alignas(64) float buf[kChunk];
  const uint8_t* row = a.w + n * a.row_bytes;
  for (int64_t k0 = 0; k0 < a.K; k0 += kChunk) {
    const int64_t len = a.K - k0 < kChunk ? a.K - k0 : kChunk;
    const float* src = deq + k0;
    if (!whole) {
      dequant_chunk(a.type, row, k0, len, buf);
      src = buf;
    }
    dot_chunk<MT>(a, m0, k0, len, src, acc);
  }
  const float b = a.bias ? a.bias[n] : 0.f;
  for (int r = 0; r < MT; ++r) a.y[(m0 + r) * a.N + n] = Isa::reduce(acc[r]) + b;
}

void rows(const Args& a, int64_t n0, int64_t n1) {
  constexpr int kTile = 4;  // x rows per pass over a W row
  // more than one pass: dequantize the row once into a buffer (L1/L2) that every pass reads
  const bool whole = a.M > kTile;
  std::vector<float> row_buf(whole ? a.K : 0);
  float* deq = row_buf.data();
  for (int64_t n = n0; n < n1; ++n) {
    if (whole) dequant_chunk(a.type, a.w + n * a.row_bytes, 0, a.K, deq);
    int64_t m = 0;
    for (; m + kTile <= a.M; m += kTile) group<kTile>(a, n, m, deq, whole);
    switch (a.M - m) {
      case 3: group<3>(a, n, m, deq, whole); break;
      case 2: group<2>(a, n, m, deq, whole); break;
      case 1: group<1>(a, n, m, deq, whole); break;
      default: break;
    }
  }
}
