// Decode attention on CPU that reads keys and values where they lie in the paged KV cache.
//
// One query token per sequence attends over that sequence's first context_lens[b] cached
// positions, found through its block table. Work items are (sequence, KV head) pairs, run in
// parallel on torch's intra-op thread pool; each item computes the scores of its group of query
// heads against every key (each key row read once for the whole group), a softmax in float32,
// then the weighted sum of the value rows. No key or value is copied out of the cache.
//
// Built on first use by serve_app/engine/cpu_kernels.py (torch.utils.cpp_extension) and
// registered as torch.ops.serve_app_cpu.paged_decode_attention.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const c10::BFloat16* p, int64_t i) {
  // bfloat16 is the high half of a float32
  uint16_t raw;
  std::memcpy(&raw, p + i, sizeof(raw));
  uint32_t bits = static_cast<uint32_t>(raw) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline void store(float* p, int64_t i, float x) { p[i] = x; }

inline void store(c10::BFloat16* p, int64_t i, float x) { p[i] = c10::BFloat16(x); }

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * load(b, i);
  return sum;
}

// a += p * b
template <typename T>
inline void axpy(float* __restrict a, float p, const T* __restrict b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) a[i] += p * load(b, i);
}

// exp(x) for a whole row, x <= 0 (scores minus their maximum): x = k ln2 + r with |r| <= ln2/2,
// exp(r) by its Taylor series to r^7 (relative error below 2e-7), 2^k put into the exponent
// bits. Plain arithmetic, so the compiler vectorises the loop.
void exp_row(float* x, int64_t n) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.42860682030941723212e-6f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float v = std::max(x[i], -87.0f);  // below, exp underflows; 2^k stays a normal float
    float t = v * kLog2e + kRound;
    float k = t - kRound;
    int32_t ki;
    std::memcpy(&ki, &t, sizeof(ki));
    ki -= 0x4B400000;  // the bits of kRound: leaves the integer k
    float r = v - k * kLn2Hi - k * kLn2Lo;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t scale_bits = (ki + 127) << 23;
    float scale;
    std::memcpy(&scale, &scale_bits, sizeof(scale));
    x[i] = p * scale;
  }
}

// kDim: the head size when known at compile time (the loops over it then unroll into whole
// vector registers), 0 for any other head size.
template <typename T, int64_t kDim>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                      const int64_t* lens, T* out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t table_width, int64_t max_len, float scale) {
  const int64_t dim = kDim ? kDim : head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * dim;  // one cached token of one layer
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
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
        const T* qg = q + (b * num_heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) query[g * dim + d] = load(qg, d) * scale;
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
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * max_len;
        float top = s[0];
        for (int64_t t = 1; t < len; ++t) top = std::max(top, s[t]);
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) s[t] -= top;
        exp_row(s, len);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) total += s[t];
        inverse[g] = 1.0f / total;
      }
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
        T* og = out + (b * num_heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) store(og, d, acc[g * dim + d] * inverse[g]);
      }
    }
  });
}

template <typename T>
void dispatch_head_dim(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                       const int64_t* lens, T* out, int64_t num_seqs, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                       int64_t table_width, int64_t max_len, float scale) {
  auto run = [&](auto kernel) {
    kernel(q, k_cache, v_cache, tables, lens, out, num_seqs, num_heads, num_kv_heads, head_dim,
           block_size, table_width, max_len, scale);
  };
  switch (head_dim) {
    case 64: return run(decode_attention<T, 64>);
    case 128: return run(decode_attention<T, 128>);
    default: return run(decode_attention<T, 0>);
  }
}

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
  const auto q = query.contiguous();
  const auto tables = block_tables.contiguous();
  const auto lens = context_lens.contiguous();
  const int64_t* len_data = lens.data_ptr<int64_t>();
  int64_t max_len = 1;
  for (int64_t b = 0; b < num_seqs; ++b) {
    TORCH_CHECK(len_data[b] >= 1 && len_data[b] <= tables.size(1) * block_size,
                "context length out of the block table's range");
    max_len = std::max(max_len, len_data[b]);
  }
  auto out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    dispatch_head_dim<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(),
                            v_cache.data_ptr<float>(), tables.data_ptr<int64_t>(), len_data,
                            out.data_ptr<float>(), num_seqs, num_heads, num_kv_heads, head_dim,
                            block_size, tables.size(1), max_len, s);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    dispatch_head_dim<c10::BFloat16>(
        q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(),
        v_cache.data_ptr<c10::BFloat16>(), tables.data_ptr<int64_t>(), len_data,
        out.data_ptr<c10::BFloat16>(), num_seqs, num_heads, num_kv_heads, head_dim, block_size,
        tables.size(1), max_len, s);
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
