// The ISA-generic body of the skinny GEMM, included once per ISA inside its namespace and
// `#pragma GCC target` region, after a `struct Isa` that supplies the vector type and primitives
// (V, L, kMaxMT, zero, fma, load, reduce, wf32, wf32_tail, Raw, wbf16, wbf16_tail, even, odd,
// prefetch, deinterleave). Deliberately no includes: the including file provides <algorithm> and <cstdint>.
//
// Shape of the work: the W rows of one call are streamed once from memory. A register tile is R
// output columns (W rows) x MT rows of x; all M rows of x are served from the same W block,
// re-read from L1/L2 rather than memory, by walking K in tiles small enough to stay in L1.

using V = Isa::V;
constexpr int kMaxR = 4;                  // W rows per register tile
constexpr int kGroupM = 16;               // x rows per pass over a W block (accumulators on the stack)
constexpr int64_t kTileBytes = 32 << 10;  // a K tile of the W block and of the x group stays in L1
constexpr int64_t kPrefetchBytes = 1024;  // how far ahead of the stream the first pass prefetches

// One step of K for an R x MT tile: fp32 W, L elements.
template <int R, int MT, bool TAIL>
inline __attribute__((always_inline)) void step_f32(const float* w, int64_t K, const float* x, int64_t Kp,
                                                    int64_t k, int rem, V (&acc)[MT][R]) {
  V xv[MT];
  for (int m = 0; m < MT; ++m) xv[m] = Isa::load(x + m * Kp + k);
  for (int r = 0; r < R; ++r) {
    V wv = TAIL ? Isa::wf32_tail(w + r * K + k, rem) : Isa::wf32(w + r * K + k);
    for (int m = 0; m < MT; ++m) acc[m][r] = Isa::fma(wv, xv[m], acc[m][r]);
  }
}

// One step of K for an R x MT tile: bf16 W, 2L elements. bf16 -> fp32 is exact: the even
// element of each 32-bit word is its low half shifted up, the odd one is the word with the low
// half cleared. x was laid out [even lanes | odd lanes] per block to match.
template <int R, int MT, bool TAIL>
inline __attribute__((always_inline)) void step_bf16(const uint16_t* w, int64_t K, const float* x, int64_t Kp,
                                                     int64_t k, int rem, V (&acc)[MT][R]) {
  V xe[MT], xo[MT];
  for (int m = 0; m < MT; ++m) {
    xe[m] = Isa::load(x + m * Kp + k);
    xo[m] = Isa::load(x + m * Kp + k + Isa::L);
  }
  for (int r = 0; r < R; ++r) {
    Isa::Raw raw = TAIL ? Isa::wbf16_tail(w + r * K + k, rem) : Isa::wbf16(w + r * K + k);
    V we = Isa::even(raw), wo = Isa::odd(raw);
    for (int m = 0; m < MT; ++m) {
      acc[m][r] = Isa::fma(we, xe[m], acc[m][r]);
      acc[m][r] = Isa::fma(wo, xo[m], acc[m][r]);
    }
  }
}

// acc (rows of kMaxR vectors, MT of them) += W[R rows, k0:k1] . x[MT rows, k0:k1].
template <bool BF16, int R, int MT>
void tile(const void* wp, int64_t K, const float* x, int64_t Kp, int64_t k0, int64_t k1, V* accp, bool prefetch) {
  constexpr int S = BF16 ? 2 * Isa::L : Isa::L;  // K elements per step
  constexpr int64_t elt = BF16 ? 2 : 4;
  V acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = accp[m * kMaxR + r];
  const int64_t kend = std::min(k1, K);
  const int64_t kfull = k0 + (kend - k0) / S * S;
  const char* wb = static_cast<const char*>(wp);
  for (int64_t k = k0; k < kfull; k += S) {
    if (prefetch)  // one cache line per row per step: fp32 steps are 64 B, bf16 steps too (AVX-512)
      for (int r = 0; r < R; ++r) Isa::prefetch(wb + (r * K + k) * elt + kPrefetchBytes);
    if constexpr (BF16)
      step_bf16<R, MT, false>(static_cast<const uint16_t*>(wp), K, x, Kp, k, 0, acc);
    else
      step_f32<R, MT, false>(static_cast<const float*>(wp), K, x, Kp, k, 0, acc);
  }
  if (kfull < kend) {
    if constexpr (BF16)
      step_bf16<R, MT, true>(static_cast<const uint16_t*>(wp), K, x, Kp, kfull, int(kend - kfull), acc);
    else
      step_f32<R, MT, true>(static_cast<const float*>(wp), K, x, Kp, kfull, int(kend - kfull), acc);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) accp[m * kMaxR + r] = acc[m][r];
}

using TileFn = void (*)(const void*, int64_t, const float*, int64_t, int64_t, int64_t, V*, bool);

// table[r - 1][mt - 1] for the R x MT tile of a (possibly short) block.
template <bool BF16, int... MTs>
struct TileRow {
  template <int R>
  static constexpr void fill(TileFn* row) {
    int i = 0;
    ((row[i++] = &tile<BF16, R, MTs>), ...);
  }
};

template <bool BF16>
struct TileTable {
  TileFn fn[kMaxR][Isa::kMaxMT];
  TileTable() {
    fill(std::make_integer_sequence<int, Isa::kMaxMT>{});
  }
  template <int... I>
  void fill(std::integer_sequence<int, I...>) {
    TileRow<BF16, (I + 1)...>::template fill<1>(fn[0]);
    TileRow<BF16, (I + 1)...>::template fill<2>(fn[1]);
    TileRow<BF16, (I + 1)...>::template fill<3>(fn[2]);
    TileRow<BF16, (I + 1)...>::template fill<4>(fn[3]);
  }
};

// x [M, K] -> xp [M, Kp], zero-padded to whole blocks of 2L. For bf16 weights each block is
// reordered [x0 x2 x4 ... | x1 x3 x5 ...] to line up with the even / odd halves of the 32-bit
// words the weights are widened from (step_bf16).
void prepare_x(const float* x, int64_t M, int64_t K, int64_t Kp, bool bf16, float* xp) {
  constexpr int B = 2 * Isa::L;
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = xp + m * Kp;
    if (!bf16) {
      std::copy(src, src + K, dst);
      std::fill(dst + K, dst + Kp, 0.f);
      continue;
    }
    int64_t b = 0;
    for (; b + B <= K; b += B) Isa::deinterleave(src + b, dst + b);
    if (b < Kp) {
      float tail[B] = {};
      std::copy(src + b, src + K, tail);
      Isa::deinterleave(tail, dst + b);
    }
  }
}

void rows(const GemvArgs& a, int64_t n0, int64_t n1) {
  static const TileTable<false> f32_tiles;
  static const TileTable<true> bf16_tiles;
  const auto& table = a.bf16 ? bf16_tiles.fn : f32_tiles.fn;
  const int64_t elt = a.bf16 ? 2 : 4;
  const int64_t step = a.bf16 ? 2 * Isa::L : Isa::L;
  // K elements per tile: W [kMaxR, kt] + x [min(M, kGroupM), kt] fit in kTileBytes.
  const int64_t per_k = kMaxR * elt + std::min<int64_t>(a.M, kGroupM) * int64_t(sizeof(float));
  const int64_t kt = std::max<int64_t>(step, kTileBytes / per_k / step * step);
  const char* w = static_cast<const char*>(a.w);
  V acc[kGroupM * kMaxR];
  for (int64_t nb = n0; nb < n1; nb += kMaxR) {
    const int r = int(std::min<int64_t>(kMaxR, n1 - nb));
    const char* wblock = w + nb * a.K * elt;
    for (int64_t mg = 0; mg < a.M; mg += kGroupM) {
      const int gm = int(std::min<int64_t>(kGroupM, a.M - mg));
      for (int i = 0; i < gm * kMaxR; ++i) acc[i] = Isa::zero();
      for (int64_t k0 = 0; k0 < a.K; k0 += kt) {
        for (int mc = 0; mc < gm; mc += Isa::kMaxMT) {
          const int mt = std::min(Isa::kMaxMT, gm - mc);
          // Only the first pass over this W block reads memory; prefetch for it alone.
          table[r - 1][mt - 1](wblock, a.K, a.x + (mg + mc) * a.Kp, a.Kp, k0, k0 + kt, acc + mc * kMaxR,
                               mg == 0 && mc == 0);
        }
      }
      for (int m = 0; m < gm; ++m) {
        float* yrow = a.y + (mg + m) * a.N + nb;
        for (int j = 0; j < r; ++j) yrow[j] = Isa::reduce(acc[m * kMaxR + j]) + (a.bias ? a.bias[nb + j] : 0.f);
      }
    }
  }
}
