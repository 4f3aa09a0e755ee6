// The IQ4 dequantizers of the block GEMM: included by quant_tile.h inside its ISA namespace, after
// `Isa`, `V`, `VI`, `L` and `f16` (no include guard: one copy per ISA instance, as quant_tile.h).
// IQ4_NL (18 bytes: d, qs[16]) and IQ4_XS (136: d, scales_h, scales_l[4], qs[128]): 4-bit indices into
// 16 non-uniform levels, times one float per 32 weights (IQ4_XS: d * (6-bit scale - 32)). The 16 products
// dl * level are the sub-block's table, each code picks its value: ggml's y = dl * kvalues[q] exactly.
static constexpr float kIq4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

template <class Sink>
static inline void deq_iq4_32(const uint8_t* qs, float dl, Sink&& sink) {  // one sub-block of 32 weights
  const V s = Isa::set1(dl);
  V t[16 / L];  // the table dl * level, in 16 / L registers
  for (int i = 0; i < 16 / L; ++i) t[i] = Isa::mul(s, Isa::loadu(kIq4Levels + i * L));
#pragma GCC unroll 2
  for (int i = 0; i < 16; i += L) {
    const VI q = Isa::u8(qs + i);
    sink(i, Isa::table16(Isa::and_(q, Isa::iset1(15)), t));
    sink(16 + i, Isa::table16(Isa::srl(q, 4), t));
  }
}

template <class Sink>
static inline void deq_iq4_nl(const uint8_t* b, Sink&& sink) {
  deq_iq4_32(b + 2, f16(b), sink);
}

template <class Sink>
static inline void deq_iq4_xs(const uint8_t* b, Sink&& sink) {
  const float d = f16(b);
  uint16_t h;
  __builtin_memcpy(&h, b + 2, 2);
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const int ls = ((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((h >> (2 * j)) & 3) << 4);
    deq_iq4_32(b + 8 + 16 * j, d * float(ls - 32), [&](int off, V w) { sink(32 * j + off, w); });
  }
}
