// Decode attention's arithmetic: dot products and scaled adds, prefetching cache rows, exp and
// a softmax row in kLanes lanes, the folds that finish kLanes dot products at once, and each
// dtype's query (a bfloat16 query through AVX512-BF16 dot products where the build has them).
// Part of paged_decode_attention.cpp.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include "elements.h"
#include "spare_cores.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace serve_app_cpu::attention {

using serve_app_cpu::FlushDenormals;
using serve_app_cpu::kLanes;
using serve_app_cpu::narrow;
using serve_app_cpu::vf;
using serve_app_cpu::vi;
using serve_app_cpu::vload;
using serve_app_cpu::widen;

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * widen(b[i]);
  return sum;
}

// a += p * b
template <typename T>
inline void axpy(float* __restrict a, float p, const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += p * widen(b[i]);
}

// Ask for `bytes` of the cache ahead of their use. A work item reads one head's part of each
// cached token's row, `row` elements apart: on its own, the hardware prefetcher keeps too few
// of those in flight, and the sequence's other heads read the rest of the same rows next.
template <int kLocality, typename T>
inline void prefetch(const T* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + line, 0, kLocality);
}

constexpr int64_t kAhead = 16;  // keys are asked for this many tokens ahead

// exp(x) for kLanes lanes, x <= 0 (scores minus their maximum): x = k ln2 + r with |r| <= ln2/2,
// exp(r) by its Taylor series to r^7 (relative error below 2e-7), 2^k put into the exponent bits.
inline vf vexp(vf x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf floor = vf{} - 87.0f;   // below, exp underflows; 2^k stays a normal float
  x = x < floor ? floor : x;
  const vf t = x * kLog2e + kRound;
  const vf k = t - kRound;
  const vi ki = (vi)t - 0x4B400000;  // the bits of kRound: leaves the integer k
  const vf r = x - k * kLn2Hi - k * kLn2Lo;
  vf p = vf{} + 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * (vf)((ki + 127) << 23);
}

// s[t] = exp(s[t] - max(s)) over a row, kLanes at a time; returns 1 / sum(s), the softmax's
// normaliser. The tail past the last whole kLanes is padded in a register, never read or written.
float softmax_row(float* s, int64_t len) {
  const int64_t whole = len - len % kLanes;
  float top = s[0];
  if (whole) {
    vf m = vload(s);
    for (int64_t t = kLanes; t < whole; t += kLanes) {
      const vf x = vload(s + t);
      m = x > m ? x : m;
    }
    for (int64_t l = 0; l < kLanes; ++l) top = std::max(top, m[l]);
  }
  for (int64_t t = whole; t < len; ++t) top = std::max(top, s[t]);
  vf sum{};
  for (int64_t t = 0; t < whole; t += kLanes) {
    const vf e = vexp(vload(s + t) - top);
    std::memcpy(s + t, &e, sizeof(e));
    sum += e;
  }
  float total = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) total += sum[l];
  if (whole < len) {
    const int64_t rest = len - whole;
    vf x = vf{} - 87.0f;  // exp of it is ~1e-38; not summed below
    for (int64_t l = 0; l < rest; ++l) x[l] = s[whole + l] - top;
    const vf e = vexp(x);
    for (int64_t l = 0; l < rest; ++l) {
      s[whole + l] = e[l];
      total += e[l];
    }
  }
  return 1.0f / total;
}

// Lane i of the result: the sum of the i-th pair of lanes H apart in a followed by b (a's pairs,
// then b's); I are the lanes 0 .. kLanes - 1.
template <int64_t H, std::size_t... I>
inline vf fold(vf a, vf b, std::index_sequence<I...>) {
  constexpr vi lo = {static_cast<int32_t>(I / H * 2 * H + I % H)...};
  constexpr vi hi = {static_cast<int32_t>(I / H * 2 * H + I % H + H)...};
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// 2H vectors folded into one, level by level
template <int64_t H>
inline vf fold_all(vf* a) {
  for (int64_t i = 0; i < H; ++i)
    a[i] = fold<H>(a[2 * i], a[2 * i + 1], std::make_index_sequence<kLanes>{});
  if constexpr (H == 1) {
    return a[0];
  } else {
    return fold_all<H / 2>(a);
  }
}

// sum(v[i]) for kLanes vectors at once, lane i of the result: kLanes - 1 folds instead of
// kLanes reductions
inline vf sum_lanes(const vf* v) {
  vf a[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) a[i] = v[i];
  return fold_all<kLanes / 2>(a);
}

// One key row of a query head's dot products, as kLanes of partial sums (sum_lanes finishes them).
// The query is held widened to float32 and already scaled.
template <int64_t kVecs>
struct FloatQuery {
  vf q[kVecs];
  template <typename T>
  void set(const T* row, float scale) {
    for (int64_t j = 0; j < kVecs; ++j) q[j] = vload(row + j * kLanes) * scale;
  }
  template <typename T>
  vf dot(const T* key) const {
    vf sum = q[0] * vload(key);
    for (int64_t j = 1; j < kVecs; ++j) sum += q[j] * vload(key + j * kLanes);
    return sum;
  }
  static constexpr bool kScaledAfter = false;
};

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bfloat16 query and keys on CPUs with AVX512-BF16: vdpbf16ps multiplies 32 pairs at once and
// adds each two neighbouring products into a float32 lane (a product of two bfloat16 numbers is
// exact in float32), so keys are used as stored, never widened. The scale is applied to the sums.
template <int64_t kVecs>
struct Bf16Query {
  static constexpr int64_t kPairs = kVecs / 2;  // 32 bfloat16 per register
  __m512bh q[kPairs];
  void set(const c10::BFloat16* row, float) {
    for (int64_t j = 0; j < kPairs; ++j) q[j] = (__m512bh)_mm512_loadu_si512(row + j * 32);
  }
  vf dot(const c10::BFloat16* key) const {
    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(key));
    for (int64_t j = 1; j < kPairs; ++j)
      sum = _mm512_dpbf16_ps(sum, q[j], (__m512bh)_mm512_loadu_si512(key + j * 32));
    return (vf)sum;
  }
  static constexpr bool kScaledAfter = true;
};

template <typename T, int64_t kVecs>
struct QueryFor {
  using type = FloatQuery<kVecs>;
};
template <int64_t kVecs>
struct QueryFor<c10::BFloat16, kVecs> {
  using type = Bf16Query<kVecs>;
};
#else
template <typename T, int64_t kVecs>
struct QueryFor {
  using type = FloatQuery<kVecs>;
};
#endif

}  // namespace serve_app_cpu::attention
