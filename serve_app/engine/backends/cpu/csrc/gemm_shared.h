// The streamed GEMM shared with helper threads on spare cores (spare_cores.h): how large a
// chunk is, measured as it runs, and the job that cuts a GEMM into chunks. Part of
// streamed_gemm.cpp.
#pragma once

#include "gemm_pass.h"
#include "spare_cores.h"

namespace serve_app_cpu::gemm {

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

}  // namespace serve_app_cpu::gemm
