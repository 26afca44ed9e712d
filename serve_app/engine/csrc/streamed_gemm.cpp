// A GEMM that reads its weight once per call as a stream, for weights that do not stay in the
// CPU's caches between uses: the LM head (151936 x 512 on the demo model, 311 MB in float32) and
// the decoder layers' projections, multiplied by a decode step's few dozen rows.
//
// streamed_linear(x [M, K], packed [blocks, K, 32], n, bias=None, other=None, epilogue=0)
//   -> x @ W^T (+ bias) [M, n], then + other (epilogue 1) or * other (epilogue 2), with W [n, K]
//   packed by cpu_gemm.StreamedLinear: 32 of its rows per block, transposed so that each k holds
//   the block's 32 weights side by side, the last block padded with zeros. x, W, bias, other and
//   the result share a dtype: float32, or bfloat16 (widened to float32 exactly, summed and
//   finished in float32, rounded to nearest-even once, as a bfloat16 GEMM with fused ops rounds).
//
// At a few dozen rows such a GEMM is neither compute- nor memory-bound alone: a weight block
// takes as long to arrive from memory as to multiply, and oneDNN's blocked kernel does one after
// the other (measured on a 2-core Xeon at 32 rows: 25.7 ms for the demo's head, while the memory
// alone takes 11 ms and the arithmetic alone ~17 ms). Here every block is multiplied in register
// tiles of up to 12 rows x 32 columns (24 accumulators) while the block after next is asked into
// L2, its lines spread evenly over the tiles' k loops: 19-20 ms. Each output is one k-ordered
// float32 sum. More rows than 48 (a prefill) go through each thread's blocks again, 48 at a time.
// bfloat16 is used here only on CPUs without bfloat16 arithmetic (cpu_gemm.streams), where
// oneDNN's bfloat16 GEMM runs at a quarter of its float32 rate.
//
// Registered as torch.ops.serve_app_cpu.streamed_linear by serve_app/engine/cpu_kernels.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "elements.h"  // with <immintrin.h> on AVX-512

// measured on AVX-512 only: other CPUs keep oneDNN's GEMM
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

using serve_app_cpu::kLanes;
using serve_app_cpu::vload;
using serve_app_cpu::widen16;

constexpr int64_t kCols = 2 * kLanes;  // weight rows per packed block
constexpr int64_t kRows = 12;          // 24 of the 32 vector registers hold accumulators
constexpr int64_t kMaxRows = 48;       // rows multiplied per pass over the weight
constexpr int64_t kAheadBlocks = 2;    // blocks asked for ahead of their use
constexpr int64_t kLine = 64;          // bytes per cache line

template <typename T>
inline __m512 load(const T* p) {  // 16 elements as float32
  return (__m512)vload(p);
}

inline __mmask16 first(int64_t count) {
  return count >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

inline void store(float* out, __m512 v, int64_t count) {
  _mm512_mask_storeu_ps(out, first(count), v);
}

// rounded to nearest-even as c10::BFloat16 rounds (a NaN becomes its quiet NaN)
inline void store(c10::BFloat16* out, __m512 v, int64_t count) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_srli_epi32(rounded, 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(out, first(count), _mm512_cvtepi32_epi16(rounded));
}

inline __m512 load(const float* p, int64_t count) {
  return _mm512_maskz_loadu_ps(first(count), p);
}

inline __m512 load(const c10::BFloat16* p, int64_t count) {
  return widen16(_mm256_maskz_loadu_epi16(first(count), p));
}

// What is applied to a sum before it is stored: + bias[column], then + other[row, column]
// (kAdd) or * other[row, column] (kMul), all in float32 before the one rounding.
enum Epilogue : int64_t { kNone = 0, kAdd = 1, kMul = 2 };

template <typename T>
struct Finish {
  const T* bias;   // [n] or null, at the block's first column
  const T* other;  // [M, n] rows with stride ld_other, at the tile's first row and column
  int64_t ld_other;
  Epilogue kind;

  __m512 apply(__m512 v, int64_t r, int64_t col, int64_t count) const {
    if (bias != nullptr) v = _mm512_add_ps(v, load(bias + col, count));
    if (kind == kNone) return v;
    const __m512 o = load(other + r * ld_other + col, count);
    return kind == kAdd ? _mm512_add_ps(v, o) : _mm512_mul_ps(v, o);
  }
};

// out[r, :cols] = x[r, :] @ block for R rows (x: rows K apart), finished; while multiplying,
// `fetch` lines from `ahead` (consecutive, `per_k` for each k) are asked into L2.
template <int64_t R, typename T>
void tile(const float* x, int64_t K, const T* block, T* out, int64_t ldo, int64_t cols,
          const Finish<T>& finish, const char* ahead, int64_t fetch, int64_t per_k) {
  __m512 acc[R][2];
  for (int64_t r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = load(block + k * kCols);
    const __m512 w1 = load(block + k * kCols + kLanes);
    if (k * per_k < fetch) {
      for (int64_t j = 0; j < per_k; ++j) __builtin_prefetch(ahead + (k * per_k + j) * kLine, 0, 2);
    }
    for (int64_t r = 0; r < R; ++r) {
      // row r as row 3 * (r / 3) plus 0, 1 or 2 rows: GCC then keeps the loop's addresses out
      // of the FMA ports (written x[r * K + k], 2-6 % slower here: row addresses moved between
      // vector and general registers on port 0 in every iteration)
      const __m512 a = _mm512_set1_ps(x[(r / 3) * 3 * K + k + (r % 3) * K]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    store(out + r * ldo, finish.apply(acc[r][0], r, 0, cols), cols);
    if (cols > kLanes) {
      store(out + r * ldo + kLanes, finish.apply(acc[r][1], r, kLanes, cols - kLanes),
            cols - kLanes);
    }
  }
}

template <typename T, int64_t... Rs>
void tile_of(int64_t rows, std::integer_sequence<int64_t, Rs...>, const float* x, int64_t K,
             const T* block, T* out, int64_t ldo, int64_t cols, const Finish<T>& finish,
             const char* ahead, int64_t fetch, int64_t per_k) {
  ((rows == Rs + 1
        ? tile<Rs + 1>(x, K, block, out, ldo, cols, finish, ahead, fetch, per_k)
        : void()),
   ...);
}

// The rows in groups of at most kRows, each multiplied by a register tile: slices of equal size
// of at most kMaxRows rows (one pass over the weight each), each cut into groups of sizes that
// differ by one at most (32 rows: 11, 11, 10).
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

// x: float32 [M, K], contiguous (a bfloat16 x is widened first, exactly). Each thread
// takes a range of blocks and goes through it once per slice of rows, so a many-row x (a prefill)
// meets no barrier between slices and each thread's blocks stay in its cache from one slice to
// the next.
template <typename T>
void gemm(const float* xd, const std::vector<std::vector<Group>>& slices, const T* wd, T* od,
          int64_t K, int64_t n, int64_t blocks, Finish<T> finish) {
  const int64_t block_size = K * kCols;
  const int64_t lines = block_size * static_cast<int64_t>(sizeof(T)) / kLine;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (const auto& slice : slices) {
      const int64_t passes = static_cast<int64_t>(slice.size());
      const int64_t per_pass = (lines + passes - 1) / passes;  // lines asked for by each tile
      const int64_t per_k = K ? (per_pass + K - 1) / K : 0;
      for (int64_t b = begin; b < end; ++b) {
        const T* block = wd + b * block_size;
        const int64_t cols = std::min(kCols, n - b * kCols);
        const bool ask = b + kAheadBlocks < end;  // the blocks past `end` are another thread's
        const char* ahead = reinterpret_cast<const char*>(block + kAheadBlocks * block_size);
        for (int64_t pass = 0; pass < static_cast<int64_t>(slice.size()); ++pass) {
          const Group g = slice[pass];
          const int64_t start = pass * per_pass;
          const int64_t fetch = ask ? std::max<int64_t>(0, std::min(per_pass, lines - start)) : 0;
          Finish<T> here = finish;  // at the tile's first row and the block's first column
          if (here.bias != nullptr) here.bias += b * kCols;
          if (here.kind != kNone) here.other += g.row0 * here.ld_other + b * kCols;
          tile_of(g.rows, std::make_integer_sequence<int64_t, kRows>{}, xd + g.row0 * K, K,
                  block, od + g.row0 * n + b * kCols, n, cols, here, ahead + start * kLine,
                  fetch, per_k);
        }
      }
    }
  });
}

template <typename T>
Finish<T> finish_of(const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& other,
                    int64_t kind) {
  const bool with_other = kind != kNone;
  return {bias ? bias->data_ptr<T>() : nullptr, with_other ? other->data_ptr<T>() : nullptr,
          with_other ? other->stride(0) : 0, static_cast<Epilogue>(kind)};
}

// x @ W^T (+ bias) (+ or * other, by `epilogue`: 0 none, 1 add, 2 mul)
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
  TORCH_CHECK(epilogue == kNone || epilogue == kAdd || epilogue == kMul, "unknown epilogue");
  TORCH_CHECK(epilogue == kNone || (other && other->dim() == 2 && other->size(0) == M &&
                                    other->size(1) == n && other->stride(1) == 1 &&
                                    other->scalar_type() == x.scalar_type()),
              "other must be [M, n] with contiguous rows, in x's dtype");
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;  // (K == 0 goes through: the tiles finish sums of nothing, zeros)
  const auto slices = slice_rows(M);
  const auto xf = x.to(at::kFloat).contiguous();
  const float* xd = xf.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    gemm(xd, slices, packed.data_ptr<float>(), out.data_ptr<float>(), K, n, blocks,
         finish_of<float>(bias, other, epilogue));
  } else {
    gemm(xd, slices, packed.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), K, n,
         blocks, finish_of<c10::BFloat16>(bias, other, epilogue));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(serve_app_cpu, m) {
  m.def(
      "streamed_linear(Tensor x, Tensor packed, int n, Tensor? bias=None, Tensor? other=None, "
      "int epilogue=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(serve_app_cpu, CPU, m) { m.impl("streamed_linear", &streamed_linear); }

#endif
