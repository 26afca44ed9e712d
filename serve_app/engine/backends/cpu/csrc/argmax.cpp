// Greedy sampling's argmax over a step's logits, read in the model's dtype.
//
// argmax_rows(x [rows, width]) -> int64 [rows]: torch.argmax(x, dim=1) exactly (the first
//   maximum; a NaN counts as larger than any number, so a row's first NaN wins). For bfloat16
//   logits it saves the float32 copy of the whole step's logits (32 x 151936 values: ~1.3 ms
//   of a ~26 ms step on 2 cores), and torch's own CPU argmax runs several times slower than a
//   max reduction. Pass one finds the row's maximum (and whether it has a NaN) in vectorised
//   loops; pass two, over the row again (now in cache), finds its first position. Where helper
//   threads run on spare cores (spare_cores.h), the rows are shared with them, one chunk each.
//
// torch.ops.serve_app_cpu.argmax_rows (ops.cpp).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "elements.h"
#include "spare_cores.h"

namespace {

using serve_app_cpu::kLanes;
using serve_app_cpu::vf;
using serve_app_cpu::vi;
using serve_app_cpu::vload;
using serve_app_cpu::widen;

constexpr int64_t kChunk = 4 * kLanes;  // pass two tests this many elements before looking

inline bool any(vi mask) {
  int64_t words[sizeof(vi) / sizeof(int64_t)];
  std::memcpy(words, &mask, sizeof(words));
  int64_t all = 0;
  for (int64_t w : words) all |= w;
  return all != 0;
}

template <typename T>
int64_t first_max(const T* x, int64_t width) {
  const int64_t whole = width - width % kLanes;
  vf top = vf{} - std::numeric_limits<float>::infinity();
  vi nans{};
  for (int64_t i = 0; i < whole; i += kLanes) {
    const vf v = vload(x + i);
    nans |= v != v;
    top = v > top ? v : top;  // a NaN never replaces a number
  }
  float best = -std::numeric_limits<float>::infinity();
  bool nan = any(nans);
  for (int64_t l = 0; l < kLanes; ++l) best = top[l] > best ? top[l] : best;
  for (int64_t i = whole; i < width; ++i) {
    const float v = widen(x[i]);
    nan |= v != v;
    best = v > best ? v : best;
  }
  auto wins = [&](float v) { return nan ? v != v : v == best; };
  const vf target = vf{} + best;
  for (int64_t start = 0; start < whole; start += kChunk) {
    const int64_t end = std::min(whole, start + kChunk);
    vi hit{};
    for (int64_t i = start; i < end; i += kLanes) {
      const vf v = vload(x + i);
      hit |= nan ? v != v : v == target;
    }
    if (!any(hit)) continue;
    for (int64_t i = start; i < end; ++i)
      if (wins(widen(x[i]))) return i;
  }
  for (int64_t i = whole; i < width; ++i)
    if (wins(widen(x[i]))) return i;
  return 0;  // not reached: the maximum (or a NaN) is in the row
}

// out[r] = the first maximum of row r: shared with the helpers (a row per chunk, ~50 us for a
// 151936-wide row) when some run and there are two rows or more, else on the torch threads
template <typename T>
void argmax_all(const at::Tensor& x, at::Tensor& out) {
  const T* data = x.data_ptr<T>();
  const int64_t rows = x.size(0), width = x.size(1), stride = x.stride(0);
  int64_t* result = out.data_ptr<int64_t>();
  auto compute = [data, width, stride](int64_t begin, int64_t end, int64_t* into) {
    for (int64_t r = begin; r < end; ++r) into[r - begin] = first_max(data + r * stride, width);
  };
  if (serve_app_cpu::spare_helpers() > 0 && rows > 1) {
    std::vector<int64_t> bounds(rows + 1);
    for (int64_t r = 0; r <= rows; ++r) bounds[r] = r;
    serve_app_cpu::run_dense(std::move(bounds), 1, result, compute, x);
    return;
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    compute(begin, end, result + begin);
  });
}

}  // namespace

namespace serve_app_cpu {

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [rows, width] with width > 0");
  TORCH_CHECK(x.stride(1) == 1, "x's rows must be contiguous");
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) {
    argmax_all<float>(x, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    argmax_all<c10::BFloat16>(x, out);
  }
  return out;
}

}  // namespace serve_app_cpu
