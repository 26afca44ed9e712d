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

// s[t] = exp(s[t] - max(s)) over a row; returns 1 / sum(s), the softmax's normaliser
float softmax_row(float* s, int64_t len) {
  float top = s[0];
  for (int64_t t = 1; t < len; ++t) top = std::max(top, s[t]);
#pragma omp simd
  for (int64_t t = 0; t < len; ++t) s[t] -= top;
  exp_row(s, len);
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < len; ++t) total += s[t];
  return 1.0f / total;
}

// Any head size, in plain loops (head sizes with a vectorised path use decode_attention_vec).
template <typename T>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                      const int64_t* lens, T* out, int64_t num_seqs, int64_t num_heads,
                      int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                      int64_t table_width, int64_t max_len, float scale) {
  const int64_t dim = head_dim;
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
        T* og = out + (b * num_heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) store(og, d, acc[g * dim + d] * inverse[g]);
      }
    }
  });
}

// --- whole 16-float vectors (GCC/Clang vector extensions: AVX-512 registers here, two AVX2 or
// four NEON registers elsewhere), for head sizes that are a multiple of 16 ----------------------

constexpr int64_t kLanes = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));

inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf vload(const c10::BFloat16* p) {
  vh half;
  std::memcpy(&half, p, sizeof(half));
  vi bits = __builtin_convertvector(half, vi) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

// a[i] + a[i + k] folded pairwise from two vectors, by the lane masks lo and hi
inline vf fold(vf a, vf b, vi lo, vi hi) {
  return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// sum(v[i]) for 16 vectors at once, lane i of the result: 15 folds instead of 16 reductions
inline vf sum16(const vf* v) {
  const vi lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold(v[2 * i], v[2 * i + 1], lo1, hi1);
  for (int i = 0; i < 4; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], lo2, hi2);
  for (int i = 0; i < 2; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], lo3, hi3);
  return fold(c[0], c[1], lo4, hi4);
}

// kVecs = head_dim / 16. Each key and value row is loaded (and widened from bfloat16) once for
// the whole group of query heads; scores come 16 tokens at a time.
template <typename T, int64_t kVecs>
void decode_attention_vec(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                          const int64_t* lens, T* out, int64_t num_seqs, int64_t num_heads,
                          int64_t num_kv_heads, int64_t block_size, int64_t table_width,
                          int64_t max_len, float scale) {
  constexpr int64_t dim = kVecs * kLanes;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row = num_kv_heads * dim;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<vf> query(group * kVecs), acc(group * kVecs), partial(group * kLanes);
    std::vector<float> scores(group * (max_len + kLanes)), inverse(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads;
      const int64_t h = item % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * table_width;
      const int64_t stride = max_len + kLanes;  // room for a whole last chunk of 16
      for (int64_t g = 0; g < group; ++g) {
        const T* qg = q + (b * num_heads + h * group + g) * dim;
        for (int64_t j = 0; j < kVecs; ++j) query[g * kVecs + j] = vload(qg + j * kLanes) * scale;
      }
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
            vf k[kVecs];
            for (int64_t j = 0; j < kVecs; ++j) k[j] = vload(keys + (chunk + i) * row + j * kLanes);
            for (int64_t g = 0; g < group; ++g) {
              vf sum = query[g * kVecs] * k[0];
              for (int64_t j = 1; j < kVecs; ++j) sum += query[g * kVecs + j] * k[j];
              partial[g * kLanes + i] = sum;
            }
          }
          for (int64_t g = 0; g < group; ++g) {
            vf sums = sum16(partial.data() + g * kLanes);
            std::memcpy(scores.data() + g * stride + first + chunk, &sums, sizeof(sums));
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        inverse[g] = softmax_row(scores.data() + g * stride, len);
      std::fill(acc.begin(), acc.end(), vf{});
      for (int64_t first = 0; first < len; first += block_size) {
        const T* values = v_cache + table[first / block_size] * block_size * row + h * dim;
        const int64_t count = std::min(block_size, len - first);
        for (int64_t i = 0; i < count; ++i) {
          vf v[kVecs];
          for (int64_t j = 0; j < kVecs; ++j) v[j] = vload(values + i * row + j * kLanes);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * stride + first + i];
            for (int64_t j = 0; j < kVecs; ++j) acc[g * kVecs + j] += p * v[j];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* og = out + (b * num_heads + h * group + g) * dim;
        for (int64_t j = 0; j < kVecs; ++j) {
          const vf o = acc[g * kVecs + j] * inverse[g];
          for (int64_t l = 0; l < kLanes; ++l) store(og, j * kLanes + l, o[l]);
        }
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
  auto run_vec = [&](auto kernel) {
    kernel(q, k_cache, v_cache, tables, lens, out, num_seqs, num_heads, num_kv_heads, block_size,
           table_width, max_len, scale);
  };
  switch (head_dim) {
    case 64: return run_vec(decode_attention_vec<T, 4>);
    case 128: return run_vec(decode_attention_vec<T, 8>);
    case 256: return run_vec(decode_attention_vec<T, 16>);
    default: return run(decode_attention<T>);
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
