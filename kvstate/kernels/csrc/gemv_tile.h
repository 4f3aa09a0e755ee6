// The ISA-generic body of the skinny GEMM, included once per ISA inside its namespace and
// `#pragma GCC target` region, after a `struct Isa` that supplies the vector type and primitives
// (V, L, zero, fma, load, reduce, wf32, wf32_tail, wi8, wi8_tail, Raw, wbf16, wbf16_tail, even, odd,
// prefetch, deinterleave, keep) and the register tiles it runs (`Isa::Plan<bf16, row class>`: R, MT,
// kWregs; int8 weights run fp32's tiles, widened to fp32 as they are loaded).
// Deliberately no includes: the including file provides <algorithm>, <cstdint> and <type_traits>.
//
// Shape of the work: the W rows of one call are streamed once from memory. A register tile is R
// output columns (W rows) x MT rows of x; all M rows of x are served from the same W block of R
// rows, re-read from L1/L2 rather than memory (one pass per MT rows), by walking K in tiles small
// enough to stay in L1. Every pass prefetches its share of a K tile kAheadTiles on (in the next
// blocks after a row's last tiles), so memory keeps streaming while the later passes compute.

using V = Isa::V;
constexpr int kMaxR = 4;                  // W rows per register tile, at most (accumulator stride)
constexpr int kGroupM = 16;               // x rows per pass over a W block (accumulators on the stack)
constexpr int64_t kTileBytes = 32 << 10;  // a K tile of the W block and of the x group stays in L1
// How far ahead a pass prefetches, in K tiles: one tile (~4 KiB of rows) was too close for the 8-row
// passes, which compute long enough per line to catch up with the memory (bf16 weights, 8 rows, Zen 5:
// 39 -> 32 ms over 1 GB; AVX2 52 -> 49; 1, 2, 4 and 16 rows unchanged).
constexpr int64_t kAheadTiles = 2;

// L weights of one W row as fp32: fp32 as they are, int8 widened exactly (the row's scale is applied
// once, to the sum).
template <bool TAIL, typename T>
inline __attribute__((always_inline)) V wload(const T* p, int rem) {
  if constexpr (std::is_same_v<T, int8_t>)
    return TAIL ? Isa::wi8_tail(p, rem) : Isa::wi8(p);
  else
    return TAIL ? Isa::wf32_tail(p, rem) : Isa::wf32(p);
}

// One step of K for an R x MT tile: fp32 or int8 W, L elements. WREGS: the R W vectors stay in
// registers and each x vector is loaded once for R FMAs; else the MT x vectors stay and W is loaded
// per row.
template <int R, int MT, bool TAIL, bool WREGS, typename T>
inline __attribute__((always_inline)) void step_f32(const T* w, int64_t K, const float* x, int64_t Kp,
                                                    int64_t k, int rem, V (&acc)[MT][R]) {
  if constexpr (WREGS) {
    V wv[R];
    for (int r = 0; r < R; ++r) wv[r] = wload<TAIL>(w + r * K + k, rem);
    for (int m = 0; m < MT; ++m) {
      V xv = Isa::load(x + m * Kp + k);
      Isa::keep(xv);
      for (int r = 0; r < R; ++r) acc[m][r] = Isa::fma(wv[r], xv, acc[m][r]);
    }
  } else {
    V xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = Isa::load(x + m * Kp + k);
    for (int r = 0; r < R; ++r) {
      V wv = wload<TAIL>(w + r * K + k, rem);
      for (int m = 0; m < MT; ++m) acc[m][r] = Isa::fma(wv, xv[m], acc[m][r]);
    }
  }
}

// One step of K for an R x MT tile: bf16 W, 2L elements. bf16 -> fp32 is exact: the even
// element of each 32-bit word is its low half shifted up, the odd one is the word with the low
// half cleared. x was laid out [even lanes | odd lanes] per block to match.
template <int R, int MT, bool TAIL, bool WREGS>
inline __attribute__((always_inline)) void step_bf16(const uint16_t* w, int64_t K, const float* x, int64_t Kp,
                                                     int64_t k, int rem, V (&acc)[MT][R]) {
  if constexpr (WREGS) {
    V we[R], wo[R];
    for (int r = 0; r < R; ++r) {
      const Isa::Raw raw = TAIL ? Isa::wbf16_tail(w + r * K + k, rem) : Isa::wbf16(w + r * K + k);
      we[r] = Isa::even(raw), wo[r] = Isa::odd(raw);
    }
    for (int m = 0; m < MT; ++m) {
      const V xe = Isa::load(x + m * Kp + k);
      for (int r = 0; r < R; ++r) acc[m][r] = Isa::fma(we[r], xe, acc[m][r]);
      const V xo = Isa::load(x + m * Kp + k + Isa::L);
      for (int r = 0; r < R; ++r) acc[m][r] = Isa::fma(wo[r], xo, acc[m][r]);
    }
  } else {
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
}

// Where a pass prefetches: the lines kAheadTiles K tiles on (`kt` each; past the row's end, in the
// blocks of `rb` rows that follow), on the steps whose index is `phase` modulo `period` (one line per row each).
struct Prefetch {
  int64_t kt, rb;
  int phase, period;
};

// bytes per weight of each kind
constexpr int64_t elt_bytes(int wk) { return wk == kBf16 ? 2 : wk == kI8 ? 1 : 4; }

// acc (rows of kMaxR vectors, MT of them) += W[R rows, k0:k1] . x[MT rows, k0:k1]; FIRST (the first
// K tile): acc = that product, its old contents unread. Zeroing acc in memory first cost a
// quarter of a one-row call over short rows (K = 64: the stores, then loads they cannot forward).
template <int WK, int R, int MT, bool WREGS, bool FIRST>
void tile(const void* wp, int64_t K, const float* x, int64_t Kp, int64_t k0, int64_t k1, V* accp,
          const Prefetch& pf) {
  constexpr bool BF16 = WK == kBf16;
  constexpr int S = BF16 ? 2 * Isa::L : Isa::L;  // K elements per step
  constexpr int64_t elt = elt_bytes(WK);
  V acc[MT][R];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = FIRST ? Isa::zero() : accp[m * kMaxR + r];
  const int64_t kend = std::min(k1, K);
  const int64_t kfull = k0 + (kend - k0) / S * S;
  const char* wb = static_cast<const char*>(wp);
  // step i prefetches when i % period == phase: count down instead of dividing
  int until = pf.phase;
  for (int64_t k = k0; k < kfull; k += S) {
    if (until-- == 0) {
      until = pf.period - 1;
      // kAheadTiles K tiles on: in the same rows, or (past the row's end) in a later block
      const int64_t far = k + kAheadTiles * pf.kt;
      const int64_t ahead = far / K * pf.rb * K + far % K - k;
      for (int r = 0; r < R; ++r) Isa::prefetch(wb + (r * K + k + ahead) * elt);
    }
    if constexpr (BF16)
      step_bf16<R, MT, false, WREGS>(static_cast<const uint16_t*>(wp), K, x, Kp, k, 0, acc);
    else if constexpr (WK == kI8)
      step_f32<R, MT, false, WREGS>(static_cast<const int8_t*>(wp), K, x, Kp, k, 0, acc);
    else
      step_f32<R, MT, false, WREGS>(static_cast<const float*>(wp), K, x, Kp, k, 0, acc);
  }
  if (kfull < kend) {
    if constexpr (BF16)
      step_bf16<R, MT, true, WREGS>(static_cast<const uint16_t*>(wp), K, x, Kp, kfull, int(kend - kfull), acc);
    else if constexpr (WK == kI8)
      step_f32<R, MT, true, WREGS>(static_cast<const int8_t*>(wp), K, x, Kp, kfull, int(kend - kfull), acc);
    else
      step_f32<R, MT, true, WREGS>(static_cast<const float*>(wp), K, x, Kp, kfull, int(kend - kfull), acc);
  }
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < R; ++r) accp[m * kMaxR + r] = acc[m][r];
}

// (Prefetch by reference: by value its 4-byte fields were stored and read back as one 8-byte word, a
// store the load could not forward from: ~20 cycles a call, a third of a one-row call at K = 64.)
using TileFn = void (*)(const void*, int64_t, const float*, int64_t, int64_t, int64_t, V*, const Prefetch&);

// fn[first][r - 1][mt - 1]: the r x mt tile, for r <= RB and mt <= MTB (short blocks and passes);
// first: the K tile at 0.
template <int WK, int RB, int MTB, bool WREGS>
struct TileTable {
  TileFn fn[2][RB][MTB];
  TileTable() { fill_rows(std::make_integer_sequence<int, RB>{}); }
  template <int... I>
  void fill_rows(std::integer_sequence<int, I...>) {
    (fill_cols<I + 1>(std::make_integer_sequence<int, MTB>{}), ...);
  }
  template <int R, int... J>
  void fill_cols(std::integer_sequence<int, J...>) {
    ((fn[0][R - 1][J] = &tile<WK, R, J + 1, WREGS, false>), ...);
    ((fn[1][R - 1][J] = &tile<WK, R, J + 1, WREGS, true>), ...);
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

// Output columns [n0, n1) for every row of x, in blocks of RB W rows and passes of MTB x rows.
template <int WK, int RB, int MTB, bool WREGS>
void rows_with(const GemvArgs& a, int64_t n0, int64_t n1) {
  static const TileTable<WK, RB, MTB, WREGS> tiles;
  constexpr int64_t elt = elt_bytes(WK);
  constexpr int64_t step = WK == kBf16 ? 2 * Isa::L : Isa::L;
  constexpr int steps_per_line = std::max<int>(1, 64 / int(step * elt));
  // K tiles of equal length (the next tile's prefetch then lines up): W [RB, kt] + x [group, kt]
  // fit in kTileBytes.
  const int64_t per_k = RB * elt + std::min<int64_t>(a.M, kGroupM) * int64_t(sizeof(float));
  const int64_t kt_max = std::max<int64_t>(step, kTileBytes / per_k / step * step);
  const int64_t n_tiles = std::max<int64_t>(1, (a.K + kt_max - 1) / kt_max);
  const int64_t kt = ((a.K + n_tiles - 1) / n_tiles + step - 1) / step * step;
  const char* w = static_cast<const char*>(a.w);
  V acc[kGroupM * kMaxR];
  for (int64_t nb = n0; nb < n1; nb += RB) {
    const int r = int(std::min<int64_t>(RB, n1 - nb));
    const char* wblock = w + nb * a.K * elt;
    for (int64_t mg = 0; mg < a.M; mg += kGroupM) {
      const int gm = int(std::min<int64_t>(kGroupM, a.M - mg));
      const int passes = (gm + MTB - 1) / MTB;
      if (a.K == 0)  // no K tile sets them (each first tile starts its own from zero)
        for (int i = 0; i < gm * kMaxR; ++i) acc[i] = Isa::zero();
      for (int64_t k0 = 0; k0 < a.K; k0 += kt) {
        for (int mc = 0, p = 0; mc < gm; mc += MTB, ++p) {
          const int mt = std::min(MTB, gm - mc);
          // The first group's passes share the next tile's lines; a later group finds them cached.
          const Prefetch pf{kt, RB, mg == 0 ? p * steps_per_line : -1, passes * steps_per_line};
          tiles.fn[k0 == 0][r - 1][mt - 1](wblock, a.K, a.x + (mg + mc) * a.Kp, a.Kp, k0, k0 + kt, acc + mc * kMaxR,
                                           pf);
        }
      }
      for (int m = 0; m < gm; ++m) {
        float* yrow = a.y + (mg + m) * a.N + nb;
        for (int j = 0; j < r; ++j) {
          const float sum = Isa::reduce(acc[m * kMaxR + j]);
          yrow[j] = (WK == kI8 ? sum * a.scale[nb + j] : sum) + (a.bias ? a.bias[nb + j] : 0.f);
        }
      }
    }
  }
}

template <int WK, int ROWS>
const char* rows_plan(const GemvArgs& a, int64_t n0, int64_t n1) {
  using P = Isa::Plan<WK == kBf16, ROWS>;
  rows_with<WK, P::R, P::MT, P::kWregs>(a, n0, n1);
  return P::name;
}

// The plan of weight kind WK for row class `cls`.
template <int WK>
const char* rows_kind(const GemvArgs& a, int cls, int64_t n0, int64_t n1) {
  if (cls == kFewRows) return rows_plan<WK, kFewRows>(a, n0, n1);
  return cls == kMidRows ? rows_plan<WK, kMidRows>(a, n0, n1) : rows_plan<WK, kManyRows>(a, n0, n1);
}

// The ISA's plan for this call by its row class: few rows (M <= 2, or `narrow`), 5 to 8, or the
// rest. Returns the tile, e.g. "3x4".
const char* rows(const GemvArgs& a, int64_t n0, int64_t n1) {
  const int cls = a.M <= 2 || a.narrow ? kFewRows : a.M >= 5 && a.M <= 8 ? kMidRows : kManyRows;
  if (a.kind == kBf16) return rows_kind<kBf16>(a, cls, n0, n1);
  return a.kind == kI8 ? rows_kind<kI8>(a, cls, n0, n1) : rows_kind<kF32>(a, cls, n0, n1);
}
