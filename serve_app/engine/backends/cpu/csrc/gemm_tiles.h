// The streamed GEMM's register tiles: a tile of rows times one packed block's columns, summed
// in float32 and finished (bias, the epilogue, one rounding) as it is stored. Part of
// streamed_gemm.cpp.
#pragma once

#include "gemm_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace serve_app_cpu::gemm {

constexpr int64_t kCols = 32;        // weight rows per packed block (cpu_gemm.StreamedLinear)
constexpr int64_t kMaxRows = 48;     // rows multiplied per pass over the weight
constexpr int64_t kAheadBlocks = 2;  // blocks asked for ahead of their use
constexpr int64_t kPartBlocks = 2;   // blocks a helper puts in place at a time, at least,
constexpr int64_t kMaxParts = 8;     // in at most this many parts of a piece (decode)
constexpr int64_t kLine = 64;        // bytes per cache line
#if defined(SERVE_APP_BF16_PAIRS)
constexpr bool kPairs = true;
#else
constexpr bool kPairs = false;
#endif

constexpr int64_t kTileCols = 2 * kWidth;            // columns of a register tile
constexpr int64_t kTilesPerBlock = kCols / kTileCols;  // tiles side by side in a block

// What is applied to a sum before it is stored: + bias[column], then + other[row, column]
// (kAdd), * other[row, column] (kMul) or * silu(other[row, column]) (kSiluMul), all in float32
// before the one rounding.
enum Epilogue : int64_t { kNone = 0, kAdd = 1, kMul = 2, kSiluMul = 3 };

// e^x to within ~2 float32 ulps (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6
// polynomial for e^r, times 2^n), for x in [-87.3, 88.3]: below, e^-87.3 (silu's limit there is
// x, within float32); above, inf (silu's 0, as torch's float32 exp overflows from ~88.7); NaN
// stays NaN.
inline Vec exp_of(Vec x) {
  const Vec wide = x;
  x = vmin(splat(88.3f), vmax(splat(-87.3f), x));  // NaN passes: each returns its second
  const Vec n = nearest(mul(x, splat(1.44269504088896341f)));
  Vec r = fmadd(n, splat(-0.693359375f), x);  // ln 2 in two parts: r exact
  r = fmadd(n, splat(2.12194440e-4f), r);
  Vec p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, splat(1.0f)));
  return where_above(wide, 88.3f, splat(__builtin_inff()), times_pow2(p, n));
}

// silu(o) = o / (1 + e^-o) as transformers computes it, rounded to T's precision as its
// separate pass stores it (bfloat16: before the product)
template <typename T>
inline Vec silu(Vec o) {
  const Vec s = vdiv(o, add(splat(1.0f), exp_of(mul(o, splat(-1.0f)))));
  if constexpr (std::is_same_v<T, c10::BFloat16>) return to_bf16_precision(s);
  return s;
}

template <typename T>
struct Finish {
  const T* bias;   // [n] or null, at the tile's first column
  const T* other;  // [M, n] rows with stride ld_other, at the tile's first row and column
  int64_t ld_other;
  Epilogue kind;

  Vec apply(Vec v, int64_t r, int64_t col, int64_t count) const {
    if (bias != nullptr) v = add(v, load(bias + col, count));
    if (kind == kNone) return v;
    const Vec o = load(other + r * ld_other + col, count);
    if (kind == kSiluMul) return mul(v, silu<T>(o));
    return kind == kAdd ? add(v, o) : mul(v, o);
  }
};

// a register tile's R rows x 2 vectors of float32 sums, finished and stored (the columns past
// `cols`, a last block's padding, are not written)
template <int64_t R, typename T>
void store_tile(const Vec (&acc)[R][2], T* out, int64_t ldo, int64_t cols,
                const Finish<T>& finish) {
  for (int64_t r = 0; r < R; ++r) {
    store(out + r * ldo, finish.apply(acc[r][0], r, 0, cols), cols);
    if (cols > kWidth) {
      store(out + r * ldo + kWidth, finish.apply(acc[r][1], r, kWidth, cols - kWidth),
            cols - kWidth);
    }
  }
}

// Where a tile of R rows finds x[r, k]: in its rows' panel (Panel, pack_panels: k by k, the R
// rows' elements side by side; for pairs, `unit` 2, pair by pair), or in x's own rows, K apart.
// Written for the rows as row 3 * (r / 3) plus 0, 1 or 2 rows: GCC then keeps the loop's
// addresses out of the FMA ports (as x[r * K + k], 2-6 % slower on AVX-512: row addresses moved
// between vector and general registers in every iteration). A panel needs one address for all
// rows.
template <int64_t R, bool Panel, int64_t unit = 1>
inline int64_t x_at(int64_t K, int64_t r, int64_t k) {
  if constexpr (Panel) return (k / unit) * unit * R + r * unit + k % unit;
  return (r / 3) * 3 * K + k + (r % 3) * K;
}

// out[r, :cols] = x[r, :] @ block[:, :cols] for R rows (x: as x_at finds it; block: the tile's
// first column of a packed block, rows kCols apart), finished; while multiplying, `fetch` lines
// from `ahead` (consecutive, `per_k` for each k) are asked into L2.
template <int64_t R, bool Panel, typename T>
void tile(const float* x, int64_t K, const T* block, T* out, int64_t ldo, int64_t cols,
          const Finish<T>& finish, const char* ahead, int64_t fetch, int64_t per_k) {
  Vec acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  for (int64_t k = 0; k < K; ++k) {
    const Vec w0 = load(block + k * kCols);
    const Vec w1 = load(block + k * kCols + kWidth);
    if (k * per_k < fetch) {
      for (int64_t j = 0; j < per_k; ++j) __builtin_prefetch(ahead + (k * per_k + j) * kLine, 0, 2);
    }
    for (int64_t r = 0; r < R; ++r) {
      const Vec a = splat(x[x_at<R, Panel>(K, r, k)]);
      acc[r][0] = fmadd(a, w0, acc[r][0]);
      acc[r][1] = fmadd(a, w1, acc[r][1]);
    }
  }
  store_tile<R>(acc, out, ldo, cols, finish);
}

#if defined(SERVE_APP_BF16_PAIRS)
// The same for a bfloat16 x and a block packed in pairs of k (x: bfloat16, as x_at finds it):
// each pair of x's elements is broadcast as one 32-bit lane, and VDPBF16PS adds both
// products of a column's pair to its float32 sum at once; a last unpaired k is widened and
// multiplied as above.
template <int64_t R, bool Panel>
void pair_tile(const c10::BFloat16* x, int64_t K, const c10::BFloat16* block, c10::BFloat16* out,
               int64_t ldo, int64_t cols, const Finish<c10::BFloat16>& finish, const char* ahead,
               int64_t fetch, int64_t per_k) {
  Vec acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero();
  const int64_t pairs = K / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    const c10::BFloat16* both = block + 2 * p * kCols;  // the pair's 64 weights
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(both);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(both + kCols);
    if (2 * p * per_k < fetch) {
      for (int64_t j = 0; j < 2 * per_k; ++j) {
        __builtin_prefetch(ahead + (2 * p * per_k + j) * kLine, 0, 2);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      int32_t two;  // x[r, 2p] and x[r, 2p + 1]
      std::memcpy(&two, x + x_at<R, Panel, 2>(K, r, 2 * p), sizeof(two));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(two);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, a);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, a);
    }
  }
  if (K % 2 != 0) {
    const Vec w0 = load(block + (K - 1) * kCols);
    const Vec w1 = load(block + (K - 1) * kCols + kWidth);
    for (int64_t r = 0; r < R; ++r) {
      // (in a panel, the last k's elements side by side after the pairs: unit 1 finds them)
      const Vec a = splat(static_cast<float>(x[x_at<R, Panel>(K, r, K - 1)]));
      acc[r][0] = fmadd(a, w0, acc[r][0]);
      acc[r][1] = fmadd(a, w1, acc[r][1]);
    }
  }
  store_tile<R>(acc, out, ldo, cols, finish);
}
#endif

// whether a bfloat16 weight is packed in pairs of k here (the layout cpu_gemm packs it in)
bool streamed_bf16_pairs() { return kPairs; }

// x as the register tiles read it: float32 (a bfloat16 x widened first, exactly), or its own
// bfloat16 elements for a weight packed in pairs
template <typename T>
using XOf = std::conditional_t<std::is_same_v<T, c10::BFloat16> && kPairs,
                               c10::BFloat16, float>;

template <typename T, bool Panel, int64_t... Rs>
void tile_of(int64_t rows, std::integer_sequence<int64_t, Rs...>, const XOf<T>* x, int64_t K,
             const T* block, T* out, int64_t ldo, int64_t cols, const Finish<T>& finish,
             const char* ahead, int64_t fetch, int64_t per_k) {
  if constexpr (std::is_same_v<XOf<T>, float>) {
    ((rows == Rs + 1
          ? tile<Rs + 1, Panel>(x, K, block, out, ldo, cols, finish, ahead, fetch, per_k)
          : void()),
     ...);
  } else {
#if defined(SERVE_APP_BF16_PAIRS)
    ((rows == Rs + 1
          ? pair_tile<Rs + 1, Panel>(x, K, block, out, ldo, cols, finish, ahead, fetch, per_k)
          : void()),
     ...);
#endif
  }
}

}  // namespace serve_app_cpu::gemm
