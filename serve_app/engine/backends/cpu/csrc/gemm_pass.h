// One pass of a packed weight over slices of rows: the rows cut into groups of register tiles,
// a decode step's rows packed as panels, a range of blocks multiplied by every slice. Part of
// streamed_gemm.cpp.
#pragma once

#include "gemm_tiles.h"

namespace serve_app_cpu::gemm {

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

}  // namespace serve_app_cpu::gemm
