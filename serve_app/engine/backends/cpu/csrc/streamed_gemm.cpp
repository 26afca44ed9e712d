// A GEMM that reads its weight once per call as a stream, for weights that do not stay in the
// CPU's caches between uses: the LM head (151936 x 512 on the demo model, 311 MB in float32) and
// the decoder layers' projections, multiplied by a decode step's few dozen rows.
//
// streamed_linear(x [M, K], packed [blocks, K, 32], n, bias=None, other=None, epilogue=0)
//   -> x @ W^T (+ bias) [M, n], then + other (epilogue 1), * other (epilogue 2) or
//   * silu(other) (epilogue 3: a gated MLP's up projection times its activated gate), W [n, K]
//   packed by cpu_gemm.StreamedLinear: 32 of its rows per block, transposed so that each k holds
//   the block's 32 weights side by side, the last block padded with zeros. x, W, bias, other and
//   the result share a dtype: float32, or bfloat16 (summed and finished in float32, rounded to
//   nearest-even once, as a bfloat16 GEMM with fused ops rounds). On CPUs with bfloat16
//   arithmetic (AVX512-BF16; streamed_bf16_pairs() says true) a bfloat16 weight is packed in
//   pairs: for k and k + 1, the block's 32 columns' two weights side by side (column j's pair at
//   2j), a last unpaired k (K odd) as above, and each pair of products is summed by one
//   VDPBF16PS, which reads bfloat16 subnormals as zero. Elsewhere bfloat16 is widened to float32
//   exactly and summed k by k.
//
// At a few dozen rows such a GEMM is neither compute- nor memory-bound alone: a weight block
// takes as long to arrive from memory as to multiply, and oneDNN's blocked kernel does one after
// the other (measured on a 2-core Xeon at 32 rows: 25.7 ms for the demo's head, while the memory
// alone takes 11 ms and the arithmetic alone ~17 ms). Here every block is multiplied in register
// tiles of up to 12 rows x 32 columns (24 accumulators; on AVX2, two tiles of up to 6 rows x 16
// columns side by side) while the block after next is asked into L2, its lines spread evenly over
// the tiles' k loops: 19-20 ms. Each output is one k-ordered float32 sum. More rows than 48 (a
// prefill) go through each thread's blocks again, 48 at a time. Where helper threads run on spare
// cores (spare_cores.h, ModelConfig engineSpareCpus), a GEMM of two chunks or more is shared with
// them, chunk by chunk, with the same sums in the same order. Without bfloat16 arithmetic,
// oneDNN's bfloat16 GEMM runs at a quarter of its float32 rate (with AVX-512) or cannot run at
// all (AVX2 only); with it, the pairs make this kernel about as fast as oneDNN's on one core,
// and only this one can be shared with the helpers.
//
// Registered as torch.ops.serve_app_cpu.streamed_linear by serve_app/engine/backends/cpu/kernels.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "elements.h"
#include "spare_cores.h"

// Built where it was measured: AVX-512 (Intel Xeon) and AVX2 with FMA (AMD EPYC without AVX-512);
// other CPUs keep oneDNN's GEMM.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SERVE_APP_STREAMED_GEMM 512
#if defined(__AVX512BF16__)
#define SERVE_APP_BF16_PAIRS 1  // bfloat16 weights packed in pairs of k, summed by VDPBF16PS
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define SERVE_APP_STREAMED_GEMM 256
#endif

#if defined(SERVE_APP_STREAMED_GEMM)

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

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

// The vector operations a register tile needs, on `kWidth` floats at a time. A tile is up to
// `kRows` rows x two vectors of columns; `load`/`store` with a count touch only the first
// `count` lanes (a last block's columns past n).
#if SERVE_APP_STREAMED_GEMM == 512
// AVX-512: two vectors are a whole block of 32 columns; 24 of the 32 vector registers hold
// accumulators.
using Vec = __m512;
constexpr int64_t kWidth = 16;
constexpr int64_t kRows = 12;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }

template <typename T>
inline Vec load(const T* p) {  // 16 elements as float32
  return (Vec)serve_app_cpu::vload(p);
}

inline __mmask16 first(int64_t count) {
  return count >= kWidth ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

inline void store(float* out, Vec v, int64_t count) {
  _mm512_mask_storeu_ps(out, first(count), v);
}

// each lane's bfloat16 bit pattern (in its low 16 bits), rounded to nearest-even as
// c10::BFloat16 rounds (a NaN becomes its quiet NaN)
inline __m512i bf16_bits(Vec v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_srli_epi32(rounded, 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}

inline void store(c10::BFloat16* out, Vec v, int64_t count) {
  _mm256_mask_storeu_epi16(out, first(count), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

// rounded to bfloat16 as `store` rounds, kept as float32
inline Vec to_bf16_precision(Vec v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

inline Vec load(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(first(count), p);
}

inline Vec load(const c10::BFloat16* p, int64_t count) {
  return serve_app_cpu::widen16(_mm256_maskz_loadu_epi16(first(count), p));
}

inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }  // b where either is NaN
inline Vec vmin(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec where_above(Vec x, float t, Vec then, Vec otherwise) {  // then where x > t
  return _mm512_mask_mov_ps(otherwise, _mm512_cmp_ps_mask(x, splat(t), _CMP_GT_OQ), then);
}
inline Vec nearest(Vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline Vec times_pow2(Vec v, Vec n) {  // v * 2^n for whole n in [-127, 128]
  return _mm512_scalef_ps(v, n);
}
#else
// AVX2: two vectors are half a block (16 columns), so a block takes two tiles side by side;
// 12 of the 16 vector registers hold accumulators, two the weights, one the row's element.
using Vec = __m256;
constexpr int64_t kWidth = 8;
constexpr int64_t kRows = 6;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }

// 8 bfloat16 bit patterns as the float32 values they are (each the high half of its float)
inline Vec widen8(__m128i half) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  return widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256i first(int64_t count) {  // all bits set in the first `count` lanes
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min(count, kWidth))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void store(float* out, Vec v, int64_t count) {
  if (count >= kWidth) {
    _mm256_storeu_ps(out, v);
  } else {
    _mm256_maskstore_ps(out, first(count), v);
  }
}

// each lane's bfloat16 bit pattern (in its low 16 bits), rounded to nearest-even as
// c10::BFloat16 rounds (a NaN becomes its quiet NaN)
inline __m256i bf16_bits(Vec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  rounded = _mm256_srli_epi32(rounded, 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                            _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// rounded to bfloat16 as `store` rounds, kept as float32
inline Vec to_bf16_precision(Vec v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(v), 16));
}

inline void store(c10::BFloat16* out, Vec v, int64_t count) {
  const __m256i rounded = bf16_bits(v);
  // each lane's bits are at most 0xFFFF, which unsigned saturation keeps as they are
  const __m128i halves = _mm_packus_epi32(_mm256_castsi256_si128(rounded),
                                          _mm256_extracti128_si256(rounded, 1));
  if (count >= kWidth) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), halves);
  } else {
    std::memcpy(out, &halves, std::max<int64_t>(count, 0) * sizeof(c10::BFloat16));
  }
}

inline Vec load(const float* p, int64_t count) {
  return count >= kWidth ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first(count));
}

inline Vec load(const c10::BFloat16* p, int64_t count) {
  if (count >= kWidth) return load(p);
  __m128i part = _mm_setzero_si128();
  std::memcpy(&part, p, std::max<int64_t>(count, 0) * sizeof(c10::BFloat16));
  return widen8(part);
}
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }  // b where either is NaN
inline Vec vmin(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec vdiv(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec where_above(Vec x, float t, Vec then, Vec otherwise) {  // then where x > t
  return _mm256_blendv_ps(otherwise, then, _mm256_cmp_ps(x, splat(t), _CMP_GT_OQ));
}
inline Vec nearest(Vec v) {
  return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline Vec times_pow2(Vec v, Vec n) {  // v * 2^n for whole n in [-126, 127]
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
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

// The rows in groups of at most kRows, each multiplied by a register tile: slices of equal size
// of at most kMaxRows rows (one pass over the weight each), each cut into groups of sizes that
// differ by one at most (32 rows: 11, 11, 10 on AVX-512; 6, 6, 5, 5, 5, 5 on AVX2).
struct Group {
  int64_t row0, rows;
};

std::vector<std::vector<Group>> slice_rows(int64_t M) {
  std::vector<std::vector<Group>> slices;
  const int64_t count = (M + kMaxRows - 1) / kMaxRows;
  for (int64_t s = 0, row0 = 0; s < count; ++s) {
    const int64_t rows = M / count + (s < M % count ? 1 : 0);
    const int64_t groups = (rows + kRows - 1) / kRows;
    std::vector<Group> slice;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t size = rows / groups + (g < rows % groups ? 1 : 0);
      slice.push_back({row0, size});
      row0 += size;
    }
    slices.push_back(std::move(slice));
  }
  return slices;
}

// The rows of a one-slice x (at most kMaxRows: a decode step's) as panels for the register
// tiles: each group's rows (rows row0.. of x) as one panel at element row0 * K, k by k, the
// group's elements for that k side by side (for a weight packed in pairs, pair by pair: the
// group's x[r, 2p], x[r, 2p + 1] side by side, then a last unpaired k's elements). A tile then
// broadcasts from one address that steps through its panel, not one per row. Measured on a Zen 4
// core at 32 rows x 512, float32: 111 GFLOP/s instead of 95 (the demo's LM head 26.8 -> 25.0 ms
// on two cores). A many-row x (a prefill) keeps its rows: its copy would cost more than it gains
// (bfloat16 prefill GEMMs 3-5 % slower with it).
template <typename X>
at::Tensor pack_panels(const at::Tensor& xs, const std::vector<Group>& slice) {
  constexpr int64_t unit = std::is_same_v<X, float> ? 1 : 2;  // elements per broadcast
  const int64_t K = xs.size(1), units = K / unit;
  auto panels = at::empty(xs.sizes(), xs.options());
  const X* from = xs.data_ptr<X>();
  X* to = panels.data_ptr<X>();
  for (const Group& g : slice) {
    const X* rows = from + g.row0 * K;
    X* panel = to + g.row0 * K;
    for (int64_t q = 0; q < units; ++q) {
      for (int64_t r = 0; r < g.rows; ++r) {
        for (int64_t e = 0; e < unit; ++e) *panel++ = rows[r * K + q * unit + e];
      }
    }
    for (int64_t k = units * unit; k < K; ++k) {
      for (int64_t r = 0; r < g.rows; ++r) *panel++ = rows[r * K + k];
    }
  }
  return panels;
}

// x: [M, K] as XOf<T> (float32, or bfloat16 for a weight in pairs), contiguous or as panels
// (pack_panels), times the packed weight's blocks. A range of blocks is gone through once per
// slice of rows, so a many-row x (a prefill) meets no barrier between slices and the range's
// blocks stay in its thread's cache from one slice to the next. A block is multiplied by one
// register tile per group of rows and per kTileCols of its columns (one on AVX-512; on AVX2 its
// left half for every group, then its right half).
template <typename T>
struct Gemm {
  const XOf<T>* xd;
  bool panels;  // xd holds pack_panels' panels, not rows
  std::vector<std::vector<Group>> slices;
  const T* wd;
  int64_t K, n, blocks;
  Finish<T> finish;

  // blocks [begin, end) of the rows of slices [s0, s1) (s1 -1: to the last) into `out`: its
  // column 0 is column begin * kCols of the result, its row 0 the result's row `row0`, its
  // rows ldo apart; the weight's blocks are asked for ahead up to `fetch_end` (-1: end)
  void blocks_into(int64_t begin, int64_t end, T* out, int64_t ldo, int64_t s0 = 0,
                   int64_t s1 = -1, int64_t row0 = 0, int64_t fetch_end = -1) const {
    if (fetch_end < 0) fetch_end = end;
    const int64_t block_size = K * kCols;
    const int64_t lines = block_size * static_cast<int64_t>(sizeof(T)) / kLine;
    if (s1 < 0) s1 = static_cast<int64_t>(slices.size());
    for (int64_t s = s0; s < s1; ++s) {
      const auto& slice = slices[s];
      const int64_t groups = static_cast<int64_t>(slice.size());
      const int64_t passes = groups * kTilesPerBlock;
      const int64_t per_pass = (lines + passes - 1) / passes;  // lines asked for by each tile
      const int64_t per_k = K ? (per_pass + K - 1) / K : 0;
      for (int64_t b = begin; b < end; ++b) {
        const T* block = wd + b * block_size;
        const int64_t cols = std::min(kCols, n - b * kCols);
        // (the blocks past fetch_end may be another thread's)
        const bool ask = b + kAheadBlocks < fetch_end;
        const char* ahead = reinterpret_cast<const char*>(block + kAheadBlocks * block_size);
        for (int64_t t = 0; t < kTilesPerBlock; ++t) {
          const int64_t col0 = t * kTileCols;  // the tiles' first column in the block
          if (col0 >= cols) break;  // a last block's right half may hold no column
          for (int64_t i = 0; i < groups; ++i) {
            const Group g = slice[i];
            const int64_t start = (t * groups + i) * per_pass;
            const int64_t fetch =
                ask ? std::max<int64_t>(0, std::min(per_pass, lines - start)) : 0;
            Finish<T> here = finish;  // at the tile's first row and column
            if (here.bias != nullptr) here.bias += b * kCols + col0;
            if (here.kind != kNone) here.other += g.row0 * here.ld_other + b * kCols + col0;
            const auto sizes = std::make_integer_sequence<int64_t, kRows>{};
            T* to = out + (g.row0 - row0) * ldo + (b - begin) * kCols + col0;
            if (panels) {
              tile_of<T, true>(g.rows, sizes, xd + g.row0 * K, K, block + col0, to, ldo,
                               cols - col0, here, ahead + start * kLine, fetch, per_k);
            } else {
              tile_of<T, false>(g.rows, sizes, xd + g.row0 * K, K, block + col0, to, ldo,
                                cols - col0, here, ahead + start * kLine, fetch, per_k);
            }
          }
        }
      }
    }
  }

  // every block, the torch threads each taking a range of them
  void run(T* od) const {
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      blocks_into(begin, end, od + begin * kCols, n);
    });
  }
};

// A block's time as the chunk size's model has it: its multiplications at ~65 GFLOP/s or its
// bytes at ~10 GB/s, whichever takes longer (one core of the first machines measured), and
// which of the two that is.
struct BlockCost {
  double ns;
  bool compute_bound;
};

BlockCost block_cost(int64_t M, int64_t K, int64_t element_size) {
  const double flops_ns = 2.0 * static_cast<double>(M * K * kCols) / 65.0;
  const double bytes_ns = static_cast<double>(K * kCols * element_size) / 10.0;
  return {std::max(1.0, std::max(flops_ns, bytes_ns)), flops_ns >= bytes_ns};
}

// How many times faster than that model this machine's callers compute a block, measured on the
// chunks they compute (an average over about the last 20), one factor for blocks the model finds
// compute-bound and one for memory-bound ones; 1 until measured. Without it a chunk could be far
// smaller than meant on a fast core (AVX512-BF16's pairs: ~7x the model's rate), and a chunk
// has a cost of its own (claiming it, a helper's copy into place, the prefetcher's new stream):
// the demo's LM head at 32 rows in 400 chunks took 6.4 ms with a helper, in 60 chunks 5.9.
std::atomic<double> measured_speed[2] = {1.0, 1.0};  // [memory-bound, compute-bound]

void note_speed(const BlockCost& cost, double blocks, double ns) {
  if (ns <= 0.0) return;
  const double sample = std::clamp(cost.ns * blocks / ns, 0.25, 64.0);
  auto& speed = measured_speed[cost.compute_bound];
  const double was = speed.load(std::memory_order_relaxed);
  speed.store(was + (sample - was) * 0.05, std::memory_order_relaxed);  // races: a lost sample
}

// Blocks per chunk when helpers share a GEMM of `blocks`: about 0.2 ms of work each at the
// measured speed (so that a caller which takes back a late helper's chunk redoes little), but
// never fewer chunks than 8 for that (so that the threads of a small GEMM still share it), nor
// smaller ones than the model alone gives.
int64_t blocks_per_chunk(int64_t M, int64_t K, int64_t element_size, int64_t blocks) {
  const BlockCost cost = block_cost(M, K, element_size);
  const double speed = measured_speed[cost.compute_bound].load(std::memory_order_relaxed);
  const auto of = [&](double factor) {
    return std::max<int64_t>(1, static_cast<int64_t>(200000.0 * factor / cost.ns));
  };
  return std::max(of(1.0), std::min(of(speed), blocks / 8));
}

// streamed_gemm_speed(float[] set=[]) -> float[]: the measured factors [memory-bound,
// compute-bound]; `set` replaces them first (tests).
std::vector<double> streamed_gemm_speed(c10::ArrayRef<double> set) {
  TORCH_CHECK(set.empty() || set.size() == 2, "set: two factors or none");
  for (size_t i = 0; i < set.size(); ++i) {
    TORCH_CHECK(set[i] > 0.0, "a speed factor must be > 0");
    measured_speed[i].store(set[i], std::memory_order_relaxed);
  }
  return {measured_speed[0].load(), measured_speed[1].load()};
}

// The GEMM shared with helpers on spare cores (spare_cores.h), in chunks of about the same
// work, then smaller pieces for the last two chunks' worth, so that the threads finish together
// and a caller which takes back the piece of a late helper at the end redoes little. A GEMM of
// one slice of rows (a decode step) is cut in blocks (`cut`), its pieces put in place by a helper
// in parts of a few blocks (`parts`); one of many rows (a prefill) in slices of rows, each with
// every block (`cut_rows`). It holds the tensors it reads: a helper whose chunk the caller took
// back may still be multiplying it after the caller returned.
template <typename T>
struct SharedGemm final : serve_app_cpu::SharedJob {
  // blocks [b0, b1) of the rows of slices [s0, s1)
  struct Piece {
    int64_t b0, b1, s0, s1;
  };

  SharedGemm(Gemm<T> gemm, int64_t M, std::vector<Piece> pieces, T* out,
             std::vector<at::Tensor> keep)
      : SharedJob(static_cast<int64_t>(pieces.size())),
        gemm(std::move(gemm)),
        M(M),
        pieces(std::move(pieces)),
        out(out),
        keep(std::move(keep)) {}

  // One slice of rows: per_chunk blocks each, then the last two chunks' worth in pieces of a
  // quarter of what is left (rounded up), down to single blocks: whichever thread claims the
  // last piece, the other waits at most a block's time for it. (In quarters of a chunk, the
  // demo's decode GEMMs at 32 rows ended on pieces of 3 blocks, ~14 us: the caller's thread
  // waited ~14 us of each ~150 us GEMM for the helper's last piece.)
  static std::vector<Piece> cut(int64_t blocks, int64_t per_chunk) {
    const int64_t head = blocks - std::min(blocks, 2 * per_chunk);
    std::vector<Piece> pieces;
    for (int64_t b = 0; b < head; b += per_chunk) {
      pieces.push_back({b, std::min(b + per_chunk, head), 0, 1});
    }
    for (int64_t b = head; b < blocks;) {
      const int64_t size = (blocks - b + 3) / 4;
      pieces.push_back({b, b + size, 0, 1});
      b += size;
    }
    return pieces;
  }

  // Many rows (a prefill): per_chunk slices of rows with every block, then the last two
  // chunks' worth in quarters (of per_chunk slices, or where that is under 4, each slice in
  // quarters of the blocks). A chunk's rows stay in its core's cache while the weight streams
  // by; cut in blocks, every chunk read all the rows again (at 4096 rows, 4 MB of them in
  // bfloat16 for each block of 32 columns): the demo's gate, down and qkv projections at 4096
  // rows took 1.06x the time of two torch threads' static halves, cut in rows 0.97x.
  static std::vector<Piece> cut_rows(int64_t blocks, int64_t per_chunk, int64_t slices) {
    const int64_t head = slices - std::min(slices, 2 * per_chunk);
    std::vector<Piece> pieces;
    for (int64_t s = 0; s < head; s += per_chunk) {
      pieces.push_back({0, blocks, s, std::min(s + per_chunk, head)});
    }
    if (per_chunk >= 4 || blocks == 1) {
      const int64_t quarter = std::max<int64_t>(1, per_chunk / 4);
      for (int64_t s = head; s < slices; s += quarter) {
        pieces.push_back({0, blocks, s, std::min(s + quarter, slices)});
      }
      return pieces;
    }
    const int64_t parts = std::min(blocks, (4 + per_chunk - 1) / per_chunk);  // per slice
    for (int64_t s = head; s < slices; ++s) {
      for (int64_t p = 0; p < parts; ++p) {
        pieces.push_back({blocks * p / parts, blocks * (p + 1) / parts, s, s + 1});
      }
    }
    return pieces;
  }

  int64_t first_row(int64_t c) const { return gemm.slices[pieces[c].s0].front().row0; }
  int64_t end_row(int64_t c) const {
    const Group& last = gemm.slices[pieces[c].s1 - 1].back();
    return last.row0 + last.rows;
  }

  // A piece of one slice (a decode step's) goes into place in at most kMaxParts parts of at
  // least kPartBlocks blocks, so that a helper's piece taken back costs the caller only the
  // parts not yet in place; a piece of several slices (a prefill's), whole.
  int64_t part_size(int64_t c) const {
    const Piece& p = pieces[c];
    if (p.s1 - p.s0 > 1) return p.b1 - p.b0;
    return std::max(kPartBlocks, (p.b1 - p.b0 + kMaxParts - 1) / kMaxParts);
  }
  int64_t parts(int64_t c) const override {
    const int64_t size = part_size(c);
    return (pieces[c].b1 - pieces[c].b0 + size - 1) / size;
  }
  // part i's blocks [b0, b1)
  std::pair<int64_t, int64_t> part_blocks(int64_t c, int64_t i) const {
    const Piece& p = pieces[c];
    const int64_t size = part_size(c);
    return {p.b0 + i * size, std::min(p.b1, p.b0 + (i + 1) * size)};
  }
  int64_t cols(int64_t b0, int64_t b1) const { return std::min(gemm.n, b1 * kCols) - b0 * kCols; }

  void run(int64_t c, int64_t from) override {  // the caller's threads: timed, for
    const Piece& p = pieces[c];                   // blocks_per_chunk
    const int64_t b0 = part_blocks(c, from).first;
    const auto start = std::chrono::steady_clock::now();
    gemm.blocks_into(b0, p.b1, out + b0 * kCols, gemm.n, p.s0, p.s1);
    const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
    const double rows = static_cast<double>(end_row(c) - first_row(c)) / static_cast<double>(M);
    note_speed(block_cost(M, gemm.K, sizeof(T)), static_cast<double>(p.b1 - b0) * rows,
               took.count());
  }

  void run_into(int64_t c, int64_t part, std::vector<char>& scratch) override {
    const Piece& p = pieces[c];
    const auto [b0, b1] = part_blocks(c, part);
    const int64_t r0 = first_row(c);
    scratch.resize(static_cast<size_t>((end_row(c) - r0) * cols(b0, b1)) * sizeof(T));
    gemm.blocks_into(b0, b1, reinterpret_cast<T*>(scratch.data()), cols(b0, b1), p.s0, p.s1, r0,
                     p.b1);
  }

  void commit(int64_t c, int64_t part, const std::vector<char>& scratch) override {
    const T* from = reinterpret_cast<const T*>(scratch.data());
    const auto [b0, b1] = part_blocks(c, part);
    const int64_t width = cols(b0, b1), r0 = first_row(c), r1 = end_row(c);
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(out + r * gemm.n + b0 * kCols, from + (r - r0) * width, width * sizeof(T));
    }
  }

  const Gemm<T> gemm;
  const int64_t M;
  const std::vector<Piece> pieces;
  T* const out;
  const std::vector<at::Tensor> keep;  // x (as the tiles read it), the weight, bias and other
};

// out = the GEMM: shared with the helpers when some run and it makes two chunks or more, else
// on the torch threads alone
template <typename T>
void gemm(Gemm<T> g, int64_t M, T* out, std::vector<at::Tensor> keep) {
  if (serve_app_cpu::spare_helpers() > 0) {
    const int64_t per_chunk = blocks_per_chunk(M, g.K, sizeof(T), g.blocks);
    const auto slices = static_cast<int64_t>(g.slices.size());
    // the same work in slices of rows (every block each): per_chunk blocks of all the rows
    const int64_t slices_per_chunk = std::max<int64_t>(1, per_chunk * slices / g.blocks);
    std::vector<typename SharedGemm<T>::Piece> pieces;
    if (slices > 1 && slices > slices_per_chunk) {
      pieces = SharedGemm<T>::cut_rows(g.blocks, slices_per_chunk, slices);
    } else if (slices == 1 && g.blocks > per_chunk) {
      pieces = SharedGemm<T>::cut(g.blocks, per_chunk);
    }
    if (!pieces.empty()) {
      serve_app_cpu::run_shared(std::make_shared<SharedGemm<T>>(std::move(g), M, std::move(pieces),
                                                                out, std::move(keep)));
      return;
    }
  }
  g.run(out);
}

template <typename T>
Finish<T> finish_of(const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& other,
                    int64_t kind) {
  const bool with_other = kind != kNone;
  return {bias ? bias->data_ptr<T>() : nullptr, with_other ? other->data_ptr<T>() : nullptr,
          with_other ? other->stride(0) : 0, static_cast<Epilogue>(kind)};
}

// x @ W^T (+ bias) (+ or * other, or * silu(other), by `epilogue`: 0 none, 1 add, 2 mul, 3
// silu-mul)
at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const c10::optional<at::Tensor>& bias,
                           const c10::optional<at::Tensor>& other, int64_t epilogue) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x and packed must both be float32 or both bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kCols && packed.is_contiguous(),
              "packed must be [blocks, K, 32], contiguous");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(packed.size(1) == K, "x and packed differ in K");
  TORCH_CHECK(n > (blocks - 1) * kCols && n <= blocks * kCols, "n does not match the blocks");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                        bias->scalar_type() == x.scalar_type()),
              "bias must be [n], contiguous, in x's dtype");
  TORCH_CHECK(epilogue == kNone || epilogue == kAdd || epilogue == kMul || epilogue == kSiluMul,
              "unknown epilogue");
  TORCH_CHECK(epilogue == kNone || (other && other->dim() == 2 && other->size(0) == M &&
                                    other->size(1) == n && other->stride(1) == 1 &&
                                    other->scalar_type() == x.scalar_type()),
              "other must be [M, n] with contiguous rows, in x's dtype");
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;  // (K == 0 goes through: the tiles finish sums of nothing, zeros)
  using XB = XOf<c10::BFloat16>;
  auto slices = slice_rows(M);
  const auto xs = x.to(x.scalar_type() == at::kFloat || std::is_same_v<XB, float>
                           ? at::kFloat
                           : at::kBFloat16)
                      .contiguous();
  const bool panels = slices.size() == 1;
  const auto xp = !panels                           ? xs
                  : xs.scalar_type() == at::kFloat ? pack_panels<float>(xs, slices[0])
                                                   : pack_panels<XB>(xs, slices[0]);
  std::vector<at::Tensor> keep{xp, packed};
  if (bias) keep.push_back(*bias);
  if (epilogue != kNone) keep.push_back(*other);
  if (x.scalar_type() == at::kFloat) {
    Gemm<float> g{xp.data_ptr<float>(), panels, std::move(slices), packed.data_ptr<float>(), K,
                  n, blocks, finish_of<float>(bias, other, epilogue)};
    gemm(std::move(g), M, out.data_ptr<float>(), std::move(keep));
  } else {
    Gemm<c10::BFloat16> g{xp.data_ptr<XB>(), panels, std::move(slices),
                          packed.data_ptr<c10::BFloat16>(), K, n, blocks,
                          finish_of<c10::BFloat16>(bias, other, epilogue)};
    gemm(std::move(g), M, out.data_ptr<c10::BFloat16>(), std::move(keep));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_app_cpu, m) {
  m.def(
      "streamed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, Tensor? other=None, "
      "int epilogue=0) -> Tensor");
  m.def("streamed_bf16_pairs() -> bool", &streamed_bf16_pairs);
  m.def("streamed_gemm_speed(float[] set=[]) -> float[]", &streamed_gemm_speed);
}

TORCH_LIBRARY_IMPL(serve_app_cpu, CPU, m) { m.impl("streamed_linear", &streamed_linear); }

#endif
