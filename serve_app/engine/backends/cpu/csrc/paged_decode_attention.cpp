// Decode attention on CPU that reads keys and values where they lie in the paged KV cache.
//
// One query token per sequence attends over that sequence's first context_lens[b] cached
// positions, found through its block table. Work items are (sequence, KV head) pairs, run in
// parallel on torch's intra-op thread pool; each item computes the scores of its group of query
// heads against every key (each key row read once for the whole group; bfloat16 keys through
// AVX512-BF16 dot products where the CPU has them), a softmax in float32 kLanes at a time,
// then the weighted sum of the value rows with its accumulators in registers. A sequence's
// first item asks for whole cache rows ahead of their use, so its other heads find them in
// cache. No key or value is copied out of the cache; the query may be a view with strided rows.
// Where helper threads run on spare cores (spare_cores.h, ModelConfig engineSpareCpus), the items
// are shared with them in chunks, each item computed the same way whoever computes it.
//
// Built on first use by serve_app/engine/backends/cpu/kernels.py (torch.utils.cpp_extension) and
// registered as torch.ops.serve_app_cpu.paged_decode_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

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

namespace {

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

// What one call attends over: the query, the caches, the sequences' block tables and lengths.
// Its work items are (sequence, KV head) pairs, item = b * num_kv_heads + h; an item's output is
// its group of query heads, group * head_dim elements, and consecutive items' outputs are
// consecutive in the result, so a run of items [begin, end) writes one dense range of it.
template <typename T>
struct Attention {
  const T* q;
  int64_t q_stride;
  const T* k_cache;
  const T* v_cache;
  const int64_t* tables;
  const int64_t* lens;
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, table_width, max_len;
  float scale;

  int64_t group() const { return num_heads / num_kv_heads; }
  int64_t items() const { return num_seqs * num_kv_heads; }
  int64_t item_size() const { return group() * head_dim; }  // output elements per item
};

// Items [begin, end) of `a`, their outputs from `out` on (item begin's first element).
template <typename T>
using Items = void (*)(const Attention<T>& a, int64_t begin, int64_t end, T* out);

// Any head size, in plain loops (head sizes with a vectorised path use vec_items).
template <typename T>
void plain_items(const Attention<T>& a, int64_t begin, int64_t end, T* out) {
  const T *q = a.q, *k_cache = a.k_cache, *v_cache = a.v_cache;
  const int64_t *tables = a.tables, *lens = a.lens;
  const int64_t q_stride = a.q_stride, num_kv_heads = a.num_kv_heads, block_size = a.block_size;
  const int64_t table_width = a.table_width, max_len = a.max_len;
  const float scale = a.scale;
  const int64_t dim = a.head_dim;
  const int64_t group = a.group();
  const int64_t row = num_kv_heads * dim;  // one cached token of one layer
  const FlushDenormals flush;  // this thread's, for its items
  std::vector<float> query(group * dim);
  std::vector<float> scores(group * max_len);
  std::vector<float> acc(group * dim);
  std::vector<float> inverse(group);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / num_kv_heads;
    const int64_t h = item % num_kv_heads;
    const int64_t len = lens[b];
    const int64_t* table = tables + b * table_width;
    for (int64_t g = 0; g < group; ++g) {
      const T* qg = q + b * q_stride + (h * group + g) * dim;
      for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = widen(qg[d]) * scale;
    }
    // scores[g, t] = q_g . k_t, block by block
    for (int64_t first = 0; first < len; first += block_size) {
      const T* keys = k_cache + table[first / block_size] * block_size * row + h * dim;
      const int64_t count = std::min(block_size, len - first);
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t g = 0; g < group; ++g)
          scores[g * max_len + first + i] = dot(query.data() + g * dim, keys + i * row, dim);
      }
    }
    // softmax over t, per query head
    for (int64_t g = 0; g < group; ++g)
      inverse[g] = softmax_row(scores.data() + g * max_len, len);
    // out_g = sum_t p[g, t] v_t
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t first = 0; first < len; first += block_size) {
      const T* values = v_cache + table[first / block_size] * block_size * row + h * dim;
      const int64_t count = std::min(block_size, len - first);
      for (int64_t i = 0; i < count; ++i) {
        for (int64_t g = 0; g < group; ++g)
          axpy(acc.data() + g * dim, scores[g * max_len + first + i], values + i * row, dim);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      T* og = out + ((item - begin) * group + g) * dim;
      for (int64_t d = 0; d < dim; ++d) narrow(og + d, acc[g * dim + d] * inverse[g]);
    }
  }
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

// acc[g] += p[g, t] * v_t over a context for kGroup query heads (kGroup <= 4) and one slice of
// the head 4 vectors wide, the accumulators in registers; out_g = acc[g] / sum.
template <typename T, int64_t kGroup>
void weighted_values(const T* v_cache, const int64_t* table, int64_t len, int64_t block_size,
                     int64_t row, int64_t offset, const float* scores, int64_t stride,
                     const float* inverse, T* out, int64_t out_stride) {
  constexpr int64_t kSlice = 4;
  vf acc[kGroup][kSlice] = {};
  for (int64_t first = 0; first < len; first += block_size) {
    const T* values = v_cache + table[first / block_size] * block_size * row + offset;
    const int64_t count = std::min(block_size, len - first);
    const float* p = scores + first;
    for (int64_t i = 0; i < count; ++i) {
      vf v[kSlice];
      for (int64_t j = 0; j < kSlice; ++j) v[j] = vload(values + i * row + j * kLanes);
      for (int64_t g = 0; g < kGroup; ++g) {
        const float pg = p[g * stride + i];
        for (int64_t j = 0; j < kSlice; ++j) acc[g][j] += pg * v[j];
      }
    }
  }
  for (int64_t g = 0; g < kGroup; ++g) {
    for (int64_t j = 0; j < kSlice; ++j) {
      const vf o = acc[g][j] * inverse[g];
      for (int64_t l = 0; l < kLanes; ++l) narrow(out + g * out_stride + j * kLanes + l, o[l]);
    }
  }
}

// kVecs = head_dim / kLanes. Scores come kLanes tokens at a time, each key row loaded once for
// the whole group of query heads; the weighted sum of values keeps its accumulators in
// registers, up to four query heads and 4 * kLanes dimensions per pass over the values.
template <typename T, int64_t kVecs>
void vec_items(const Attention<T>& a, int64_t begin, int64_t end, T* out) {
  using Query = typename QueryFor<T, kVecs>::type;
  constexpr int64_t dim = kVecs * kLanes;
  const T *q = a.q, *k_cache = a.k_cache, *v_cache = a.v_cache;
  const int64_t *tables = a.tables, *lens = a.lens;
  const int64_t q_stride = a.q_stride, num_kv_heads = a.num_kv_heads, block_size = a.block_size;
  const int64_t table_width = a.table_width, max_len = a.max_len;
  const float scale = a.scale;
  const int64_t group = a.group();
  const int64_t row = num_kv_heads * dim;
  const FlushDenormals flush;  // this thread's, for its items
  std::vector<Query> query(group);
  std::vector<vf> partial(group * kLanes);
  std::vector<float> scores(group * (max_len + kLanes)), inverse(group);
  for (int64_t item = begin; item < end; ++item) {
    const int64_t b = item / num_kv_heads;
    const int64_t h = item % num_kv_heads;
    const int64_t len = lens[b];
    const int64_t* table = tables + b * table_width;
    const int64_t stride = max_len + kLanes;  // room for a whole last chunk
    // the first item of a sequence in this run of items brings whole rows, all heads, into
    // cache: its keys kAhead tokens ahead and its values for the second pass
    const bool lead = h == 0 || item == begin;
    auto whole_row = [&](const T* cache, int64_t t) {
      return cache + (table[t / block_size] * block_size + t % block_size) * row;
    };
    for (int64_t g = 0; g < group; ++g)
      query[g].set(q + b * q_stride + (h * group + g) * dim, scale);
    for (int64_t first = 0; first < len; first += block_size) {
      const T* keys = k_cache + table[first / block_size] * block_size * row + h * dim;
      const int64_t count = std::min(block_size, len - first);
      for (int64_t chunk = 0; chunk < count; chunk += kLanes) {
        const int64_t n = std::min(kLanes, count - chunk);
        for (int64_t i = 0; i < kLanes; ++i) {
          if (i >= n) {  // past the context: zeros, their sums are never read
            for (int64_t g = 0; g < group; ++g) partial[g * kLanes + i] = vf{};
            continue;
          }
          const T* key = keys + (chunk + i) * row;
          if (lead) {
            const int64_t t = first + chunk + i;
            if (t + kAhead < len) prefetch<3>(whole_row(k_cache, t + kAhead), row * sizeof(T));
            prefetch<3>(whole_row(v_cache, t), row * sizeof(T));
          }
          for (int64_t g = 0; g < group; ++g) partial[g * kLanes + i] = query[g].dot(key);
        }
        for (int64_t g = 0; g < group; ++g) {
          vf sums = sum_lanes(partial.data() + g * kLanes);
          if constexpr (Query::kScaledAfter) sums *= scale;
          std::memcpy(scores.data() + g * stride + first + chunk, &sums, sizeof(sums));
        }
      }
    }
    for (int64_t g = 0; g < group; ++g)
      inverse[g] = softmax_row(scores.data() + g * stride, len);
    T* o = out + (item - begin) * group * dim;
    for (int64_t g = 0; g < group; g += 4) {
      const float* p = scores.data() + g * stride;
      for (int64_t slice = 0; slice < dim; slice += 4 * kLanes) {
        const int64_t offset = h * dim + slice;
        T* og = o + g * dim + slice;
        switch (std::min<int64_t>(4, group - g)) {
          case 1:
            weighted_values<T, 1>(v_cache, table, len, block_size, row, offset, p, stride,
                                  inverse.data() + g, og, dim);
            break;
          case 2:
            weighted_values<T, 2>(v_cache, table, len, block_size, row, offset, p, stride,
                                  inverse.data() + g, og, dim);
            break;
          case 3:
            weighted_values<T, 3>(v_cache, table, len, block_size, row, offset, p, stride,
                                  inverse.data() + g, og, dim);
            break;
          default:
            weighted_values<T, 4>(v_cache, table, len, block_size, row, offset, p, stride,
                                  inverse.data() + g, og, dim);
        }
      }
    }
  }
}

template <typename T>
Items<T> items_for(int64_t head_dim) {
  switch (head_dim) {
    case 64: return vec_items<T, 64 / kLanes>;
    case 128: return vec_items<T, 128 / kLanes>;
    case 256: return vec_items<T, 256 / kLanes>;
    default: return plain_items<T>;
  }
}

// Decode attention is shared with helpers on spare cores (spare_cores.h) in chunks of whole
// items of about kChunkWork multiply-adds each, the last 2 * kChunkWork cut in quarters (a caller
// that takes back a late helper's chunk redoes little).
constexpr int64_t kChunkWork = 1 << 19;  // ~40-80 us on one core of the machines measured

// chunk boundaries, in items: an item costs its context length times its heads' dimensions
// (the query heads' scores and values, the KV head's keys)
template <typename T>
std::vector<int64_t> chunk_bounds(const Attention<T>& a) {
  const int64_t per_token = (a.group() + 1) * a.head_dim;
  int64_t left = 0;
  for (int64_t b = 0; b < a.num_seqs; ++b) left += a.lens[b] * per_token * a.num_kv_heads;
  std::vector<int64_t> bounds{0};
  int64_t work = 0;
  for (int64_t item = 0; item < a.items(); ++item) {
    const int64_t cost = a.lens[item / a.num_kv_heads] * per_token;
    work += cost;
    left -= cost;
    const int64_t budget = left < 2 * kChunkWork ? kChunkWork / 4 : kChunkWork;
    if (work >= budget && item + 1 < a.items()) {
      bounds.push_back(item + 1);
      work = 0;
    }
  }
  bounds.push_back(a.items());
  return bounds;
}

// out = attention over `a`: shared with the helpers when some run and it makes two chunks or
// more, else on the torch threads alone
template <typename T>
void attend(const Attention<T>& a, T* out, std::vector<at::Tensor> keep) {
  const Items<T> items = items_for<T>(a.head_dim);
  if (serve_app_cpu::spare_helpers() > 0) {
    auto bounds = chunk_bounds(a);
    if (bounds.size() > 2) {
      auto compute = [a, items](int64_t begin, int64_t end, T* into) {
        items(a, begin, end, into);
      };
      serve_app_cpu::run_dense(std::move(bounds), a.item_size(), out, std::move(compute),
                               std::move(keep));
      return;
    }
  }
  at::parallel_for(0, a.items(), 1, [&](int64_t begin, int64_t end) {
    items(a, begin, end, out + begin * a.item_size());
  });
}

// query may be a view with rows apart (e.g. the query heads of a fused q/k/v projection's
// output): heads and dimensions must be dense, sequences may be strided. The result is dense.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3, "query must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim], alike");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim, "caches' head_dim differs from the query's");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_seqs &&
                  context_lens.numel() == num_seqs,
              "one block table row and one context length per sequence");
  const bool rows_dense = query.stride(2) == 1 && query.stride(1) == head_dim &&
                          query.stride(0) >= num_heads * head_dim;
  const auto q = rows_dense ? query : query.contiguous();
  const int64_t q_stride = q.stride(0);
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(len_data[b] >= 1 && len_data[b] <= tables.size(1) * block_size,
                "context length out of the block table's range");
    max_len = std::max(max_len, len_data[b]);
  }
  auto out = at::empty({num_seqs, num_heads, head_dim}, q.options());
  std::vector<at::Tensor> keep{q, k_cache, v_cache, tables, lens};
  const float s = static_cast<float>(scale);
  auto run = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const Attention<T> a{q.data_ptr<T>(), q_stride, k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                         tables.data_ptr<int64_t>(), len_data, num_seqs, num_heads, num_kv_heads,
                         head_dim, block_size, tables.size(1), max_len, s};
    attend<T>(a, out.data_ptr<T>(), std::move(keep));
  };
  if (q.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    run(static_cast<c10::BFloat16*>(nullptr));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(serve_app_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(serve_app_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
