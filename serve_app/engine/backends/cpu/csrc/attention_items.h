// Decode attention's work items, (sequence, KV head) pairs: what one call attends over, and an
// item's scores, softmax and weighted values, in plain loops for any head size or vectorised
// for the head sizes that have a path. Part of paged_decode_attention.cpp.
#pragma once

#include "attention_math.h"

namespace serve_app_cpu::attention {

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

}  // namespace serve_app_cpu::attention
